"""This process's memory as Linux counts it (``/proc/self/status``), in MB; None elsewhere.

``VmHWM`` is the peak resident memory of this process alone: ``getrusage``'s ``ru_maxrss``
carries the parent's over ``fork`` and ``exec``.
"""

from __future__ import annotations


def status_mb(key: str) -> float | None:
    """``key`` of ``/proc/self/status`` (``VmHWM``, ``VmRSS``, ``RssAnon``...), in MB."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float | None:
    """This process's peak resident memory, in MB, to 0.1."""
    got = status_mb("VmHWM")
    return None if got is None else round(got, 1)

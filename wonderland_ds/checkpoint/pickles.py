"""Reading ``torch.save`` files without torch: the globals a pickle names, and its structure.

The front process (``wonderland train``) checks a checkpoint before anything is launched. It
needs the names of the globals each pickle would call (the same static scan as torch's
``get_unsafe_globals_in_checkpoint``) and the small values in the model-states file (scheduler
state, DeepSpeed config, step counters). Importing torch for that would add seconds to every
launch, and ``torch.load`` would read every tensor's bytes to look at a few integers. Here:

* :func:`unsafe_globals` walks ``data.pkl`` opcode by opcode without running it, failing
  closed on any opcode torch's static reader does not accept;
* :func:`peek` unpickles ``data.pkl`` with every global mapped to an inert stand-in (no
  imported code ever runs) and tensors replaced by :class:`TensorStub` (shape and dtype; no
  tensor bytes are read).

``tensor_map.py`` builds on the same inert unpickler (:class:`Peeker`) to locate each tensor's
bytes in the file.

:data:`TORCH_SAFE_GLOBALS` is torch's own weights-only allowlist; a test keeps it equal to the
installed torch's.
"""

from __future__ import annotations

import codecs
import io
import pickle
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from struct import unpack
from typing import Any

_SAFE_BY_MODULE = {
    "_codecs": ("encode "),
    "builtins": ("bytearray complex set "),
    "collections": ("Counter OrderedDict "),
    "torch": (
        "BFloat16Storage BFloat16Tensor BoolStorage BoolTensor ByteStorage ByteTensor "
        "CharStorage CharTensor ComplexDoubleStorage ComplexFloatStorage DoubleStorage "
        "DoubleTensor FloatStorage FloatTensor HalfStorage HalfTensor IntStorage "
        "IntTensor LongStorage LongTensor QInt32Storage QInt8Storage QUInt2x4Storage "
        "QUInt4x2Storage QUInt8Storage ShortStorage ShortTensor Size Tensor bfloat16 "
        "bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 device "
        "float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz "
        "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu int1 int16 int2 int3 int32 int4 int5 "
        "int6 int64 int7 int8 per_channel_affine per_channel_affine_float_qparams "
        "per_channel_symmetric per_tensor_affine per_tensor_symmetric qint32 qint8 "
        "quint2x4 quint4x2 quint8 uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 "
        "uint64 uint7 uint8 "
    ),
    "torch._tensor": ("_rebuild_from_type_v2 "),
    "torch._utils": (
        "_rebuild_device_tensor_from_cpu_tensor _rebuild_device_tensor_from_numpy "
        "_rebuild_meta_tensor_no_storage _rebuild_nested_tensor _rebuild_parameter "
        "_rebuild_parameter_with_state _rebuild_qtensor _rebuild_sparse_tensor "
        "_rebuild_tensor _rebuild_tensor_v2 _rebuild_tensor_v3 _rebuild_wrapper_subclass "
    ),
    "torch.cuda": (
        "BFloat16Storage BFloat16Tensor BoolStorage BoolTensor ByteStorage ByteTensor "
        "CharStorage CharTensor ComplexDoubleStorage ComplexFloatStorage DoubleStorage "
        "DoubleTensor FloatStorage FloatTensor HalfStorage HalfTensor IntStorage "
        "IntTensor LongStorage LongTensor ShortStorage ShortTensor "
    ),
    "torch.cuda.sparse": (
        "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor "
        "IntTensor LongTensor ShortTensor "
    ),
    "torch.nn.parameter": ("Parameter "),
    "torch.serialization": ("_get_layout "),
    "torch.sparse": (
        "BFloat16Tensor ByteTensor CharTensor DoubleTensor FloatTensor HalfTensor "
        "IntTensor LongTensor ShortTensor "
    ),
    "torch.storage": ("TypedStorage UntypedStorage "),
}
TORCH_SAFE_GLOBALS = frozenset(
    f"{module}.{name}" for module, names in _SAFE_BY_MODULE.items() for name in names.split()
)


def data_pkl(path: Path | str) -> bytes:
    """The pickle record torch.load would run, read the way torch's reader finds it: the file
    must start with a zip entry (torch unpickles anything else directly, as a legacy file), and
    the record is ``<first entry's folder>/data.pkl``. Anything ambiguous (bytes before the
    zip, names that differ only in case, another ``data.pkl``) is refused, never guessed."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":
            raise ValueError("Expected input to be a checkpoint returned by torch.save")
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError("Expected input to be a checkpoint returned by torch.save") from None
    with zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        lowered = [n.lower() for n in names]
        if not infos or infos[0].header_offset != 0 or len(set(lowered)) != len(lowered):
            raise ValueError("not a plain torch.save zip (data before it, or duplicate names)")
        if any(n.split("/")[-1] == "constants.pkl" for n in lowered):
            raise ValueError(
                "Expected input to be a checkpoint returned by torch.save but got a torchscript"
                " checkpoint"
            )
        folder = lowered[0].split("/")[0]
        pkls = [n for n in lowered if n.endswith("data.pkl")]
        if pkls != [f"{folder}/data.pkl"] or f"{folder}/version" not in lowered:
            raise ValueError("Expected input to be a checkpoint returned by torch.save")
        return zf.read(names[lowered.index(f"{folder}/data.pkl")])


# Opcodes torch's static reader (torch._weights_only_unpickler.get_globals_in_pkl) accepts,
# with the fixed number of argument bytes each takes.
_P = pickle
_FIXED = {
    **dict.fromkeys(
        (
            op[0]
            for op in (
                *(_P.NEWOBJ, _P.REDUCE, _P.BUILD, _P.APPEND, _P.APPENDS, _P.SETITEM),
                *(_P.SETITEMS, _P.MARK, _P.TUPLE, _P.TUPLE1, _P.TUPLE2, _P.TUPLE3, _P.NONE),
                *(_P.NEWFALSE, _P.NEWTRUE, _P.EMPTY_TUPLE, _P.EMPTY_LIST, _P.EMPTY_DICT),
                *(_P.EMPTY_SET, _P.BINPERSID),
            )
        ),
        0,
    ),
    _P.BININT[0]: 4,
    _P.BININT1[0]: 1,
    _P.BININT2[0]: 2,
    _P.BINFLOAT[0]: 8,
    _P.BINGET[0]: 1,
    _P.LONG_BINGET[0]: 4,
    _P.BINPUT[0]: 1,
    _P.LONG_BINPUT[0]: 4,
}


def globals_in(path: Path | str) -> set[str]:
    """Every ``module.name`` the pickle in ``path`` names through GLOBAL, read statically.
    Raises pickle.UnpicklingError on an opcode the static reader cannot follow (fail closed:
    such a file cannot be checked without running it) and ValueError on a non-torch.save file."""
    data = io.BytesIO(data_pkl(path))
    read, readline = data.read, data.readline
    found: set[str] = set()
    while True:
        key = read(1)
        if not key:
            raise EOFError("pickle ends without STOP")
        op = key[0]
        if op == _P.GLOBAL[0]:
            module = readline()[:-1].decode("utf-8")
            name = readline()[:-1].decode("utf-8")
            # Protocol 2 (torch.save's) names Python 2 modules: map them as unpickling does.
            if (module, name) in NAME_MAPPING:
                module, name = NAME_MAPPING[(module, name)]
            elif module in IMPORT_MAPPING:
                module = IMPORT_MAPPING[module]
            found.add(f"{module}.{name}")
        elif op in _FIXED:
            if _FIXED[op]:
                read(_FIXED[op])
        elif op == _P.BINUNICODE[0]:
            read(unpack("<I", read(4))[0])
        elif op in (_P.SHORT_BINSTRING[0], _P.LONG1[0]):
            read(read(1)[0])
        elif op == _P.PROTO[0]:
            read(1)
        elif op == _P.STOP[0]:
            return found
        else:
            raise pickle.UnpicklingError(f"Unsupported operand {op}")


def unsafe_globals(path: Path | str) -> list[str]:
    """Like torch.serialization.get_unsafe_globals_in_checkpoint: the globals that are not on
    torch's weights-only allowlist."""
    return sorted(globals_in(path) - TORCH_SAFE_GLOBALS)


@dataclass(frozen=True)
class TensorStub:
    """A tensor's place in a peeked pickle: its shape and storage type, no data."""

    shape: tuple[int, ...]
    storage: str

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StorageRecord:
    kind: str
    numel: int
    key: str = ""


class Opaque:
    """Stand-in for any other object: takes whatever it is built with, runs nothing."""

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name, self.args = name, args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.name})"


class OpaqueObject:
    """Stand-in instance built by NEWOBJ or a call: keeps its arguments and state."""

    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class Global:
    """What a global resolves to: calling it builds an :class:`Opaque` of that name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return Opaque(self.name, *args, **kwargs)


def _rebuild_tensor(storage: Any, offset: Any = 0, size: Any = (), *rest: Any) -> TensorStub:
    kind = storage.kind if isinstance(storage, StorageRecord) else "unknown"
    return TensorStub(tuple(size) if isinstance(size, (tuple, list)) else (), kind)


REBUILDS = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
}
_PLAIN = {
    "collections.OrderedDict": OrderedDict,
    "collections.Counter": Counter,
    "builtins.set": set,
    "builtins.bytearray": bytearray,
    "builtins.complex": complex,
    "_codecs.encode": codecs.encode,
    "torch.Size": tuple,
    "torch._utils._rebuild_parameter": lambda data, *rest: data,
}


class Peeker(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[str], trust: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed, self.trust = allowed, trust

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in REBUILDS:
            return _rebuild_tensor
        if full in _PLAIN:
            return _PLAIN[full]
        if full in TORCH_SAFE_GLOBALS or full in self.allowed or self.trust:
            return Global(full)  # dtypes, storage types, allowlisted DeepSpeed classes
        raise pickle.UnpicklingError(f"global {full} is not allowlisted")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            kind = pid[1].name if isinstance(pid[1], Global) else str(pid[1])
            kind = getattr(pid[1], "qualname", kind)  # the mapper's stand-in types
            return StorageRecord(kind.rpartition(".")[2], int(pid[4]), str(pid[2]))
        raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")


def peek(path: Path | str, allowed: frozenset[str] = frozenset(), trust: bool = False) -> Any:
    """The object in a torch.save file with tensors as :class:`TensorStub` and every other
    global an inert :class:`Opaque`; nothing the file names is imported or called. A global
    outside torch's allowlist and ``allowed`` raises pickle.UnpicklingError unless ``trust``."""
    return Peeker(data_pkl(path), allowed, trust).load()

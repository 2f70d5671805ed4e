# Metadata and tool settings live in pyproject.toml; this adds the shipped DeepSpeed configs and
# hostfiles (top-level folders in the repository) to the wheel as package data.
from setuptools import find_packages, setup

SHIPPED = {
    "wonderland_ds.shipped.ds_configs": "ds_configs",
    "wonderland_ds.shipped.hostfiles": "hostfiles",
}

setup(
    packages=find_packages(include=["wonderland_ds", "wonderland_ds.*"]) + list(SHIPPED),
    package_dir=SHIPPED,
    package_data={name: ["*"] for name in SHIPPED},
)

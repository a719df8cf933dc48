# setuptools needs setup.py for cffi_modules; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["native/build_accounting.py:ffibuilder", "native/build_transfers.py:ffibuilder",
                     "native/build_journal.py:ffibuilder", "native/build_amqp_transfers.py:ffibuilder"])

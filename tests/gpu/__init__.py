# A package on purpose: a conftest.py outside any package is imported as the module "conftest", and pytest
# drops the parent's tests/conftest.py from sys.modules to load it, which breaks every `from conftest import`
# in tests/. Inside a package it is "gpu.conftest" and tests/conftest.py stays "conftest".

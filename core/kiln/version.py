"""The installed version of kiln-core (`kiln.__version__`), where saved files and the `kiln`
command read it without importing the package's API."""
from importlib import metadata

try:
    VERSION = metadata.version("kiln-core")
except metadata.PackageNotFoundError:   # run from a source tree without installing
    VERSION = "0.0.0+unknown"

"""Old import paths of moved modules: ``import mgnn.bench`` gives the module
``mgnn.studies.bench`` itself (one module object under both names), so user code, pickles and
asv histories that name the old paths keep working. Installed by ``mgnn/__init__.py``."""
import importlib
import importlib.abc
import importlib.util
import sys

#: old module name -> its home now
MOVED = {f"mgnn.{m}": f"mgnn.studies.{m}"
         for m in ("bench", "bench_spatial", "scaling", "predict", "costs", "pipeline")}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of :data:`MOVED`; loading one returns the module at its new name."""

    def __init__(self):
        self.specs = {}  # new name -> the module's own spec

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self.specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # executed under its new name already; importlib has just set __spec__ to the alias's
        module.__spec__ = self.specs[module.__name__]


def install():
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())

"""Loading the scripts of examples/ (not a package) as modules, for the example tests."""
import importlib.util
import pathlib
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """examples/<name>.py as the module `name`, loaded once per process. Registered in
    sys.modules before it runs: dataclasses look their module up while being defined, and
    one example imports another by name."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

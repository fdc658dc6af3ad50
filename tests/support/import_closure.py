"""Running a script as if only some distributions were installed: every other installed
distribution's top-level modules are made unimportable (``sys.modules[name] = None``: an
import raises ModuleNotFoundError, ``importlib.util.find_spec`` says absent), and setuptools' editable finders are
removed, so ``kvcomm`` resolves only as the script itself arranges from the checkout (as on a
machine where the project is not installed). ``PRELUDE`` is Python source that does this and then
runs ``sys.argv[1]`` as ``__main__`` with ``sys.argv[2:]``; ``KVCOMM_ALLOWED_DISTRIBUTIONS`` names
the allowed distributions (comma-separated), whose requirement closure stays importable."""

from __future__ import annotations

PRELUDE = r'''
import importlib.metadata as metadata, os, re, runpy, sys
from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

allowed, todo = set(), [norm(n) for n in os.environ["KVCOMM_ALLOWED_DISTRIBUTIONS"].split(",")]
while todo:
    name = todo.pop()
    if name in allowed:
        continue
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    allowed.add(name)
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(norm(req.name))
blocked = {module for module, dists in metadata.packages_distributions().items()
           if not any(norm(d) in allowed or norm(d) == "kvcomm" for d in dists)} - set(sys.stdlib_module_names)

sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
for module in [m for m in sys.modules if m.partition(".")[0] in blocked or m.partition(".")[0] == "kvcomm"]:
    del sys.modules[module]
for module in blocked:
    sys.modules[module] = None  # `import` raises ModuleNotFoundError, importlib.util.find_spec answers None
print("HIDDEN " + ",".join(sorted(blocked)), flush=True)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
'''

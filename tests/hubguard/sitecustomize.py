"""The Hub guard: imported at start-up by every Python process whose PYTHONPATH holds this folder (an agent the tests
start, its jobs and the zygote they fork from, check-bundle's child), it makes every way transformers could fetch or
run code from the Hub fail loudly, and notes each attempt in the file $POSTLAB_HUB_GUARD_LOG.

Guarded: the `kernels` package's entry points (kernelize, which transformers calls when a load has Hub kernels on,
and the functions that download or load a kernel) and huggingface_hub's download functions. A call writes one line
(`pid name`) to the log and raises, so a caller that swallows the error still leaves its trace. Nothing else changes:
a session that never reaches for the Hub runs exactly as without the guard.

The functions are replaced as their modules finish importing (a meta-path finder that wraps the module's loader), so
transformers' own `from kernels import kernelize` binds the guarded function, and a process that never imports
`kernels` pays nothing for it.
"""

import importlib.abc
import importlib.machinery
import os
import sys

GUARDED = {
    "kernels": ("kernelize", "get_kernel", "get_local_kernel", "get_locked_kernel", "load_kernel", "install_kernel",
                "has_kernel"),
    "huggingface_hub": ("hf_hub_download", "snapshot_download"),
    "huggingface_hub.file_download": ("hf_hub_download",),
    "huggingface_hub._snapshot_download": ("snapshot_download",),
}


class HubReached(RuntimeError):
    """A load path reached for code or files on the Hub."""


def _guarded(name: str):
    def refuse(*args, **kwargs):
        log = os.environ.get("POSTLAB_HUB_GUARD_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {name}\n")
        raise HubReached(f"the Hub guard refused {name}: nothing may be fetched from or run off the Hub")

    refuse.__name__ = name.rsplit(".", 1)[-1]
    return refuse


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in GUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_and_guard(module):
            execute(module)
            for attr in GUARDED[fullname]:
                setattr(module, attr, _guarded(f"{fullname}.{attr}"))

        spec.loader.exec_module = exec_and_guard
        return spec


sys.meta_path.insert(0, _Finder())

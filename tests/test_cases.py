"""The case language: shipped suites, every error kind, inheritance, expansion, identity."""

from __future__ import annotations

import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffcheck import cases as lang
from diffcheck.core.errors import ConfigError
from diffcheck.cases import faults as fault_spec
from diffcheck.core.types import Verdict

CASES = Path(__file__).resolve().parents[1] / "cases"
PROMPTS = """
[[prompt]]
id = "one"
text = "Write a design note about retries."

[[prompt]]
id = "two"
text = "Explain write-ahead logs."
chat = false
"""
HEAD = """
[suite]
name = "s"
description = "test suite"

[defaults]
model = "smollm2-135m"
prompts = "prompts/p.toml"
sampling = { max_tokens = 16, temperature = 0.7, seed = 1 }
engine = { dtype = "float32", kv_cache_memory_gib = 1 }
"""
REF = """
[cases.J]
role = "reference"
description = "eager"
engine = { enforce_eager = true }
"""


def write_suite(folder: Path, body: str, *, name: str = "s", head: str = HEAD, prompts: str = PROMPTS) -> Path:
    (folder / "prompts").mkdir(exist_ok=True)
    (folder / "prompts" / "p.toml").write_text(prompts)
    path = folder / f"{name}.toml"
    path.write_text(textwrap.dedent(head) + textwrap.dedent(body))
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        lang.load_suite(path)
    message = info.value.message
    assert len(message.splitlines()) == 1, message
    assert message.startswith(lang.display_path(path)), message
    return message


# --- the shipped suites -------------------------------------------------------


@pytest.mark.parametrize("name", ["default", "flash-v100-quality", "gpu-h200"])
def test_shipped_suite_loads_and_is_consistent(name):
    suite = lang.load_suite(name, cases_dir=CASES)
    assert suite.name == name and suite.cases
    for case in suite.cases.values():
        for ref in case.references:
            assert suite.cases[ref].role == "reference"
        assert lang.load_prompts(case)
        assert len(lang.config_digest(case)) == 64


def test_list_suites_finds_the_shipped_ones():
    assert {"default", "flash-v100-quality", "gpu-h200"} <= set(lang.list_suites(CASES))


@pytest.mark.parametrize("name", ["default", "gpu-h200"])
def test_every_candidate_differs_from_its_references(name):
    # A candidate whose config equals its reference's compares a run with itself. (The V100
    # suite is left out: its B = F and H = O differ by build or client, as its header says.)
    suite = lang.load_suite(name, cases_dir=CASES)
    for case in suite.cases.values():
        for ref in case.references:
            assert lang.config_delta(case, suite.cases[ref]), f"{name}: {case.id} is {ref}'s config"


@pytest.mark.parametrize("name", ["default", "gpu-h200"])
def test_fault_labels_agree_with_the_fault_registry(name):
    suite = lang.load_suite(name, cases_dir=CASES)
    for case in suite.cases.values():
        fault = fault_spec.parse_env(case.env)
        assert ("fault" in case.tags) == (fault is not None), case.id
        if fault is None:
            continue
        assert fault.info.lane == ("cuda" if "gpu" in case.tags else "cpu"), case.id  # else it never acts
        if fault.fixed:
            assert Verdict.GIBBERISH in case.expect.not_verdict, case.id
        elif case.expect.onset is not None and fault.info.takes_step:
            # a fault from step N first changes token N + 1: the label's onset must allow that
            assert abs(case.expect.onset - fault.step) <= case.expect.onset_tolerance, case.id


def test_the_makefiles_compare_case_is_a_candidate_of_its_suite():
    import re

    makefile = (CASES.parent / "Makefile").read_text()
    suite = re.search(r"^SUITE\s*\?=\s*(\S+)", makefile, re.M).group(1)
    case = re.search(r"^CASE\s*\?=\s*(\S+)", makefile, re.M).group(1)
    assert lang.get_case(lang.load_suite(suite, cases_dir=CASES), case).references  # `make compare` needs them


def _vllm_env_names() -> set[str] | None:
    """The VLLM_* variables the installed vLLM reads (its envs.py, read as text: no torch import)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    envs = Path(list(spec.submodule_search_locations)[0]) / "envs.py"
    return set(re.findall(r'^\s+"(VLLM_[A-Z0-9_]+)":', envs.read_text(), re.M)) if envs.exists() else None


@pytest.mark.parametrize("name", ["default", "flash-v100-quality", "gpu-h200"])
def test_env_names_vllm_does_not_read_are_marked_as_such(name):
    # vLLM ignores an env name it does not know, silently: a suite may set one only
    # as a fork's own variable, and must say so on that line.
    known = _vllm_env_names()
    assert known is not None, "vllm is not installed: run `make install` (this check reads vLLM's env names)"
    lines = (CASES / f"{name}.toml").read_text().splitlines()
    suite = lang.load_suite(name, cases_dir=CASES)
    for key in sorted({k for c in suite.cases.values() for k in c.env if k.startswith("VLLM_")} - known):
        where = [ln for ln in lines if ln.lstrip().startswith(("env", key)) and key in ln.split("#")[0]]
        assert where and all("stock vLLM ignores it" in ln for ln in where), f"{name}: {key}"
    assert "VLLM_ATTENTION_BACKEND" not in {k for c in suite.cases.values() for k in c.env}  # engine field instead


def test_smoke_prompts_have_two_chat_prompts():
    prompts = lang._read_prompts(CASES / "prompts" / "smoke-en.toml")
    assert [p.chat for p in prompts] == [True, True]


def test_flash_suite_o_differs_from_its_references_by_the_log_variant(monkeypatch):
    monkeypatch.delenv("QWEN36_AWQ_MODEL", raising=False)
    suite = lang.load_suite("flash-v100-quality", cases_dir=CASES)
    assert set("ABCDEFGHIJKLMNOPQ") <= set(suite.cases)
    o = suite.cases["O"]
    assert o.references == ("J", "F")
    assert lang.config_delta(o, suite.cases["J"]) == {
        "engine.cudagraph_mode": (None, "FULL_DECODE_ONLY"),
        "engine.enforce_eager": (True, False),
    }
    assert lang.config_delta(o, suite.cases["F"])["engine.attention_backend"] == ("TRITON_ATTN", "FLASH_ATTN_V100")
    assert suite.cases["C"].sampling.max_tokens == 1
    assert o.model == "/models/Qwen3.6-35B-A3B-AWQ"
    monkeypatch.setenv("QWEN36_AWQ_MODEL", "/elsewhere/qwen")
    assert lang.load_suite("flash-v100-quality", cases_dir=CASES).cases["O"].model == "/elsewhere/qwen"


# --- every error kind -----------------------------------------------------------

BAD = {
    "unknown key": (REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\nengine = { cuda_graph = "FULL" }\n',
                    "case 'O': unknown key 'engine.cuda_graph' (valid: api_key_env, attention_backend, base_url, compile_mode"),
    "unknown case key": (REF + '[cases.O]\ninherits = "J"\nrefs = ["J"]\n', "case 'O': unknown key 'refs' (valid: "),
    "wrong type": (REF + '[cases.O]\ninherits = "J"\nengine = { max_num_seqs = "four" }\n',
                   "engine.max_num_seqs must be an integer, got 'four'"),
    "bool is not an int": (REF + '[cases.O]\ninherits = "J"\nengine = { max_num_seqs = true }\n',
                           "engine.max_num_seqs must be an integer, got True"),
    "enum": (REF + '[cases.O]\ninherits = "J"\nengine = { dtype = "fp64" }\n',
             "engine.dtype must be one of auto, float32, float16, bfloat16, half, float; got 'fp64'"),
    "cudagraph enum": (REF + '[cases.O]\ninherits = "J"\nengine = { cudagraph_mode = "full" }\n',
                       "engine.cudagraph_mode must be one of NONE, PIECEWISE, FULL"),
    "range": (REF + '[cases.O]\ninherits = "J"\nengine = { compile_mode = 4 }\n',
              "engine.compile_mode must be >= 0 and <= 3, got 4"),
    "top_p range": (REF + '[cases.O]\ninherits = "J"\nsampling = { top_p = 0.0 }\n', "sampling.top_p must be > 0 and <= 1"),
    "env not a string": (REF + '[cases.O]\ninherits = "J"\nenv = { DIFFCHECK_FAULT_STEP = 32 }\n',
                         "env.DIFFCHECK_FAULT_STEP must be a string (quote it), got 32"),
    "cycle": (REF + '[cases.O]\ninherits = "E"\n[cases.E]\ninherits = "O"\n', "case 'O': inheritance cycle O -> E -> O"),
    "self cycle": (REF + '[cases.O]\ninherits = "O"\n', "inheritance cycle O -> O"),
    "unknown inherits": (REF + '[cases.O]\ninherits = "X"\n', "case 'O': inherits unknown case 'X' (valid: J, O)"),
    "unknown reference": (REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["Z"]\n',
                          "case 'O': references unknown case 'Z' (valid: J, O)"),
    "reference is a candidate": (REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\n'
                                 '[cases.E]\ninherits = "O"\nreferences = ["O"]\n',
                                 "case 'E': references 'O', which is a candidate (reference cases: J)"),
    "candidate without references": (REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\n', "a candidate needs references"),
    "missing role": ('[cases.O]\ndescription = "x"\n', "case 'O': role is required (valid: candidate, reference)"),
    "bad role": ('[cases.O]\nrole = "golden"\n', "role must be one of reference, candidate; got 'golden'"),
    "missing prompt file": (REF + '[cases.O]\ninherits = "J"\nprompts = "prompts/nope.toml"\n',
                            "case 'O': prompts file "),
    "prompts differ from reference": (REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\n'
                                      'prompts = "prompts/q.toml"\n', "differ from reference 'J'"),
    "expect onset without gibberish": (REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\n'
                                       'expect = { verdict = "IDENTICAL", onset = 3 }\n', "expect.onset needs"),
    "expect bad verdict": (REF + '[cases.O]\ninherits = "J"\nexpect = { verdict = "ERROR" }\n',
                           "expect.verdict must be one of IDENTICAL, BENIGN_DRIFT, WITHIN_BUDGET, DEGRADED, GIBBERISH"),
    "expect empty": (REF + '[cases.O]\ninherits = "J"\nexpect = { onset_tolerance = 3 }\n', "expect needs verdict"),
    "tolerance not a number": (REF + '[cases.O]\ninherits = "J"\ntolerances = { kl_p99 = "high" }\n',
                               "tolerances.kl_p99 must be a number"),
    "tags not strings": (REF + '[cases.O]\ninherits = "J"\ntags = [1]\n', "tags must be a list of strings"),
    "bad id": (REF + '[cases."a b"]\nrole = "reference"\n', "case 'a b': case ids must match"),
    "extra shadows a field": (REF + '[cases.O]\ninherits = "J"\nengine = { extra = { enforce_eager = true } }\n',
                              "engine.extra.enforce_eager duplicates engine.enforce_eager"),
    "unset variable": (REF + '[cases.O]\ninherits = "J"\nmodel = "${DIFFCHECK_TEST_SURELY_UNSET}"\n',
                       "model: environment variable DIFFCHECK_TEST_SURELY_UNSET is not set"),
    "no cases": ("", "no cases"),
    "unknown top-level": (REF + "[matrix]\nx = 1\n", "unknown top-level key 'matrix'"),
    "defaults has a case key": ("", "[defaults]: unknown key 'role'"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_error_kind_is_one_config_error_line(tmp_path, monkeypatch, kind):
    monkeypatch.delenv("DIFFCHECK_TEST_SURELY_UNSET", raising=False)
    body, expected = BAD[kind]
    head = HEAD + 'role = "reference"\n' if kind == "defaults has a case key" else HEAD
    path = write_suite(tmp_path, body, head=head)
    (tmp_path / "prompts" / "q.toml").write_text('[[prompt]]\nid = "q"\ntext = "other"\n')
    message = load_error(path)
    assert expected in message, message


# --- the fault env: refused when the suite loads, not when an engine starts --------------

FAULT_NAMES = "valid: " + ", ".join(fault_spec.valid_names())  # the registry's list, whole


@pytest.mark.parametrize(("env", "expected"), [
    ('{ DIFFCHECK_FAULT = "stale-decode-metdata" }',
     "case 'O': env: unknown fault 'stale-decode-metdata' in DIFFCHECK_FAULT (" + FAULT_NAMES),
    ('{ DIFFCHECK_FAULT = "rope-offset", DIFFCHECK_FAULT_STPE = "8" }',
     "case 'O': env: unknown variable DIFFCHECK_FAULT_STPE (valid: DIFFCHECK_FAULT, DIFFCHECK_FAULT_STEP, "),
    ('{ DIFFCHECK_FAULT = "rope-offset", DIFFCHECK_FAULT_STEP = "soon" }',
     "case 'O': env: DIFFCHECK_FAULT_STEP='soon' is not an integer"),
    ('{ DIFFCHECK_FAULT = "kv-write-corruption", DIFFCHECK_FAULT_HEAD = "1" }',
     "case 'O': env: DIFFCHECK_FAULT_HEAD does not apply to fault 'kv-write-corruption' (it takes: "),
    ('{ DIFFCHECK_FAULT_STEP = "8" }',
     "case 'O': env: DIFFCHECK_FAULT_STEP is set but DIFFCHECK_FAULT is not (valid faults: stale-decode-metadata"),
    ('{ DIFFCHECK_FAULT = "rope-offset", DIFFCHECK_FAULT_OFFSET = "0" }',
     "case 'O': env: DIFFCHECK_FAULT_OFFSET=0 would make fault 'rope-offset' a no-op"),
], ids=["misspelled fault", "misspelled key", "step not an integer", "option of another fault",
        "option without a fault", "no-op offset"])
def test_a_bad_fault_env_is_refused_when_the_suite_loads(tmp_path, env, expected):
    path = write_suite(tmp_path, REF + f'[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\nenv = {env}\n')
    message = load_error(path)  # one line, starting with the file
    assert expected in message, message


def test_the_fault_env_is_checked_after_inheritance(tmp_path):
    body = REF + """
[cases.E]
inherits = "J"
role = "candidate"
references = ["J"]
env = { DIFFCHECK_FAULT = "rope-offset" }
[cases.E8]
inherits = "E"
env = { DIFFCHECK_FAULT_STEP = "8", DIFFCHECK_FAULT_OFFSET = "-3" }
"""
    suite = lang.load_suite(write_suite(tmp_path, body))  # E8's options are valid with E's fault
    assert suite.cases["E8"].env == {"DIFFCHECK_FAULT": "rope-offset", "DIFFCHECK_FAULT_STEP": "8",
                                     "DIFFCHECK_FAULT_OFFSET": "-3"}
    # the same options where no ancestor sets the fault
    path = write_suite(tmp_path, body.replace('inherits = "E"', 'inherits = "J"'))
    assert "case 'E8': env: DIFFCHECK_FAULT_OFFSET is set but DIFFCHECK_FAULT is not" in load_error(path)


def test_cases_check_refuses_a_misspelled_fault_without_importing_the_engine(tmp_path):
    import subprocess
    import sys

    path = write_suite(tmp_path, REF + '[cases.E]\ninherits = "J"\nenv = { DIFFCHECK_FAULT = "lost-heads" }\n')
    probe = ("import sys\nfrom diffcheck.cli import main\ncode = main(['cases', 'check', sys.argv[1]])\n"
             "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'engine imported'\nsys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and "case 'E': env: unknown fault 'lost-heads' in DIFFCHECK_FAULT" in res.stderr
    assert "lost-head, lost-head:fixed" in res.stderr


@pytest.mark.parametrize("text", ["a\\nb.toml", "x\\u2028y", "z\\rw"])
def test_user_text_cannot_break_the_one_line_error(tmp_path, text):
    path = write_suite(tmp_path, REF + f'[cases.O]\ninherits = "J"\nprompts = "{text}"\n')
    assert "prompts file" in load_error(path)


def test_toml_syntax_error_names_line_and_column(tmp_path):
    path = write_suite(tmp_path, REF + "[cases.O]\ninherits = \n")
    message = load_error(path)
    assert "invalid TOML" in message and "line" in message and "column" in message


def test_suite_name_must_equal_file_stem(tmp_path):
    path = write_suite(tmp_path, REF, name="other")
    assert "name must equal the file stem 'other', got 's'" in load_error(path)


def test_one_bad_case_refuses_the_whole_suite(tmp_path):
    good = REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\n'
    assert set(lang.load_suite(write_suite(tmp_path, good)).cases) == {"J", "O"}
    path = write_suite(tmp_path, good + '[cases.X]\ninherits = "J"\nengine = { dtype = "int4" }\n')
    assert "case 'X'" in load_error(path)


@pytest.mark.parametrize(("prompts", "expected"), [
    ('[[prompt]]\nid = "a"\ntext = "x"\n[[prompt]]\nid = "a"\ntext = "y"\n', "prompt 2: duplicate id 'a'"),
    ('[[prompt]]\nid = "a"\n', "prompt 1: missing 'text'"),
    ('[[prompt]]\nid = "a"\ntext = "x"\nchat = "yes"\n', "prompt 1: chat must be true or false"),
    ('[[prompt]]\nid = "a"\ntext = "x"\nrole = "user"\n', "prompt 1: unknown key 'role'"),
    ('title = "x"\n', "unknown top-level key 'title'"),
])
def test_bad_prompt_file_is_refused_with_the_suite(tmp_path, prompts, expected):
    path = write_suite(tmp_path, REF, prompts=prompts)
    with pytest.raises(ConfigError) as info:
        lang.load_suite(path)
    assert "prompts/p.toml" in info.value.message and expected in info.value.message


def test_prompt_file_shared_system_message(tmp_path):
    prompts = 'system = "Be brief."\n[[prompt]]\nid = "a"\ntext = "x"\n[[prompt]]\nid = "b"\ntext = "y"\nsystem = "Own."\n'
    suite = lang.load_suite(write_suite(tmp_path, REF, prompts=prompts))
    assert [(p.id, p.system, p.chat) for p in lang.load_prompts(suite.cases["J"])] == [
        ("a", "Be brief.", True), ("b", "Own.", True)]


def test_unknown_suite_lists_available(tmp_path):
    write_suite(tmp_path, REF)
    with pytest.raises(ConfigError, match=r"no such suite 'nope' \(available: s\)"):
        lang.load_suite("nope", cases_dir=tmp_path)


def test_get_case_lists_valid_ids(tmp_path):
    suite = lang.load_suite(write_suite(tmp_path, REF))
    assert lang.get_case(suite, "J").id == "J"
    with pytest.raises(ConfigError, match=r"no case 'Q' in suite 's' \(valid: J\)"):
        lang.get_case(suite, "Q")


def test_cases_dir_comes_from_the_environment(tmp_path, monkeypatch):
    write_suite(tmp_path, REF)
    monkeypatch.setenv("DIFFCHECK_CASES", str(tmp_path))
    assert lang.cases_dir() == tmp_path
    assert lang.load_suite("s").path == tmp_path / "s.toml"
    monkeypatch.delenv("DIFFCHECK_CASES")
    assert lang.cases_dir() == Path("cases")


# --- inheritance ------------------------------------------------------------------

CHAIN = REF + """
[cases.O]
inherits = "J"
role = "candidate"
references = ["J"]
description = "compiled"
engine = { enforce_eager = false, max_num_seqs = 4, extra = { block_size = 32, a = { b = 1 } } }
env = { A = "1", B = "2" }
sampling = { stop = ["x", "y"] }
expect = { not_verdict = ["GIBBERISH"] }
tolerances = { kl_p99 = 0.5 }
tags = ["fast"]

[cases.E]
inherits = "O"
engine = { max_num_seqs = "default", extra = { a = { c = 2 } } }
env = { B = "3" }
sampling = { stop = ["z"], temperature = 0 }
tags = ["fault"]

[cases.E2]
inherits = "E"
engine = { dtype = "bfloat16" }
"""


def test_inheritance_merges_tables_replaces_lists_and_keeps_labels_local(tmp_path):
    suite = lang.load_suite(write_suite(tmp_path, CHAIN))
    o, e, e2 = suite.cases["O"], suite.cases["E"], suite.cases["E2"]
    # [defaults] is the root: its sampling merges under every case's
    assert e2.sampling.max_tokens == 16 and e2.sampling.seed == 1
    assert e2.engine.kv_cache_memory_gib == 1.0
    # child keys win, tables merge recursively (engine, env, extra), chain depth 3
    assert e2.engine.enforce_eager is False and e2.engine.dtype == "bfloat16"
    assert e2.env == {"A": "1", "B": "3"}
    assert e2.engine.extra == {"block_size": 32, "a": {"b": 1, "c": 2}}
    # "default" resets an inherited value to the engine default
    assert o.engine.max_num_seqs == 4 and e.engine.max_num_seqs is None
    # lists replace
    assert o.sampling.stop == ("x", "y") and e.sampling.stop == ("z",)
    assert e.tags == ("fault",) and e2.tags == ("fault",)
    # role, references and tolerances are inherited; expect and description are not
    assert (e2.role, e2.references, e2.tolerances) == ("candidate", ("J",), {"kl_p99": 0.5})
    assert o.expect is not None and e.expect is None and e.description == ""
    assert (e.inherits, e2.inherits, suite.cases["J"].inherits) == ("O", "E", None)
    # numbers are canonical floats
    assert isinstance(e.sampling.temperature, float)


def test_env_expansion(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFCHECK_TEST_MODEL", "/models/x")
    monkeypatch.delenv("DIFFCHECK_TEST_UNSET", raising=False)
    body = REF + """
[cases.A]
inherits = "J"
model = "${DIFFCHECK_TEST_MODEL}"
[cases.B]
inherits = "J"
model = "${DIFFCHECK_TEST_UNSET:-/fallback/m}"
[cases.C]
inherits = "J"
model = "${DIFFCHECK_TEST_MODEL:-/fallback/m}/sub"
[cases.D]
inherits = "J"
prompts = "${DIFFCHECK_TEST_UNSET:-prompts}/p.toml"
"""
    suite = lang.load_suite(write_suite(tmp_path, body))
    assert suite.cases["A"].model == "/models/x"
    assert suite.cases["B"].model == "/fallback/m"
    assert suite.cases["C"].model == "/models/x/sub"
    assert suite.cases["D"].prompts_file == tmp_path / "prompts" / "p.toml"


# --- identity -------------------------------------------------------------------


def test_config_delta_paths_and_values(tmp_path):
    suite = lang.load_suite(write_suite(tmp_path, CHAIN))
    j, o, e = suite.cases["J"], suite.cases["O"], suite.cases["E"]
    assert lang.config_delta(j, j) == {}
    delta = lang.config_delta(e, o)
    assert delta["engine.max_num_seqs"] == (4, None)
    assert delta["env.B"] == ("2", "3")
    assert delta["sampling.stop"] == (["x", "y"], ["z"])  # a changed list is shown whole
    assert delta["engine.extra.a.c"] == (None, 2)
    assert delta["sampling.temperature"] == (0.7, 0.0)
    assert "env.A" not in delta and "engine.enforce_eager" not in delta
    assert lang.config_delta(o, j)["env.A"] == (None, "1")


def test_config_digest_ignores_labels_and_formatting(tmp_path):
    for name in "abc":
        (tmp_path / name).mkdir()
    body = REF + '[cases.O]\ninherits = "J"\nrole = "candidate"\nreferences = ["J"]\n'
    base = lang.load_suite(write_suite(tmp_path / "a", body)).cases["O"]
    # labels, 1 vs 1.0 and prompt-file formatting do not define the run
    labelled = body + 'description = "x"\ntags = ["t"]\ntolerances = { k = 1 }\nexpect = { verdict = "IDENTICAL" }\n'
    other = lang.load_suite(write_suite(
        tmp_path / "b", labelled, head=HEAD.replace("kv_cache_memory_gib = 1", "kv_cache_memory_gib = 1.0"),
        prompts=PROMPTS.replace("chat = false", "chat   =   false  # same"))).cases["O"]
    assert lang.config_digest(other) == lang.config_digest(base)
    # prompt content does
    changed = lang.load_suite(write_suite(tmp_path / "c", body, prompts=PROMPTS.replace("retries", "timeouts"))).cases["O"]
    assert lang.config_digest(changed) != lang.config_digest(base)
    resolved = lang.resolved_config(changed)
    assert set(resolved) == {"model", "prompts", "sampling", "engine", "env"}
    assert resolved["prompts"]["count"] == 2 and resolved["engine"]["enforce_eager"] is True


@pytest.mark.parametrize(("expect", "verdict", "onset", "ok"), [
    (lang.Expect(not_verdict=(Verdict.GIBBERISH,)), Verdict.DEGRADED, None, True),
    (lang.Expect(not_verdict=(Verdict.GIBBERISH,)), Verdict.GIBBERISH, 5, False),
    (lang.Expect(verdict=Verdict.GIBBERISH, onset=32, onset_tolerance=16), Verdict.GIBBERISH, 47, True),
    (lang.Expect(verdict=Verdict.GIBBERISH, onset=32, onset_tolerance=16), Verdict.GIBBERISH, 49, False),
    (lang.Expect(verdict=Verdict.GIBBERISH, onset=32, onset_tolerance=16), Verdict.BENIGN_DRIFT, None, False),
    (lang.Expect(verdict=Verdict.IDENTICAL), Verdict.IDENTICAL, None, True),
])
def test_expect_matches(expect, verdict, onset, ok):
    assert expect.matches(verdict, onset) is ok


# --- the loader never raises anything but ConfigError -------------------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.datetimes(), st.dates(),
    st.sampled_from(["default", "vllm", "GIBBERISH", "J", "reference", "FULL", "${DIFFCHECK_TEST_SURELY_UNSET}"]),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=10)
_IDS = ["J", "O", "E", "a b"]


def _good(spec) -> st.SearchStrategy:
    """Mostly valid values for one typed key, so examples get past the first check."""
    return {
        "int": st.integers(-2, 5000), "number": st.floats(-1, 2), "bool": st.booleans(),
        "str": st.text(min_size=1, max_size=6), "enum": st.sampled_from(spec.choices or ("x",)),
        "strlist": st.lists(st.sampled_from(spec.choices or ("a", "J")), max_size=2),
        "table": st.dictionaries(st.text(max_size=4), _VALUES, max_size=2),
    }[spec.kind]


def _table(spec: dict) -> st.SearchStrategy:
    keys = st.lists(st.sampled_from(sorted(spec) + ["bogus"]), unique=True, max_size=5)
    return keys.flatmap(lambda ks: st.fixed_dictionaries(
        {k: st.one_of(_good(spec[k]), _good(spec[k]), st.just("default"), _SCALARS) if k in spec else _VALUES
         for k in ks}))


_CASE_FIELDS = {
    "inherits": st.sampled_from(_IDS), "role": st.sampled_from(["reference", "candidate"]),
    "references": st.lists(st.sampled_from(_IDS), max_size=2), "description": st.text(max_size=6),
    "model": st.sampled_from(["m", "${DIFFCHECK_TEST_X:-m}", "${DIFFCHECK_TEST_SURELY_UNSET}"]),
    "prompts": st.sampled_from(["prompts/p.toml", "prompts/q.toml", "nope.toml", "prompts"]),
    "sampling": _table(lang.SAMPLING_SPEC), "engine": _table(lang.ENGINE_SPEC), "expect": _table(lang.EXPECT_SPEC),
    "env": st.dictionaries(st.sampled_from(["A", "B", "bad name", "DIFFCHECK_FAULT", "DIFFCHECK_FAULT_STEP"]),
                           st.one_of(st.sampled_from(["lost-head", "rope-offset:fixed", "8"]), st.text(max_size=4),
                                     _SCALARS), max_size=2),
    "tolerances": st.dictionaries(st.sampled_from(["kl", "x y"]), st.one_of(st.floats(), _SCALARS), max_size=2),
    "tags": st.lists(st.text(max_size=4), max_size=2),
}


def _layer(keys) -> st.SearchStrategy:
    chosen = st.lists(st.sampled_from(list(keys) + ["bogus"]), unique=True, max_size=6)
    return chosen.flatmap(lambda ks: st.fixed_dictionaries(
        {k: st.one_of(_CASE_FIELDS[k], _CASE_FIELDS[k], _VALUES) if k in _CASE_FIELDS else _VALUES for k in ks}))


_MOSTLY_VALID = st.fixed_dictionaries({
    "suite": st.just({"name": "s"}),
    "defaults": st.fixed_dictionaries({"model": st.just("m"), "prompts": st.just("prompts/p.toml")},
                                      optional={k: _CASE_FIELDS[k] for k in ("sampling", "engine", "env", "tags")}),
    "cases": st.dictionaries(
        st.sampled_from(["J", "O", "E"]),
        st.fixed_dictionaries({"role": _CASE_FIELDS["role"]},
                              optional={k: v for k, v in _CASE_FIELDS.items() if k not in ("role", "model", "prompts")}),
        min_size=1, max_size=3),
})
_SUITE = st.one_of(
    _MOSTLY_VALID,
    st.fixed_dictionaries(
        {"suite": st.one_of(st.just({"name": "s", "description": ""}), st.just({"name": "s"}), _VALUES),
         "cases": st.dictionaries(st.sampled_from(_IDS), st.one_of(_layer(lang.CASE_KEYS), _VALUES), max_size=4)},
        optional={"defaults": st.one_of(_layer(lang.CONFIG_KEYS), _layer(lang.CONFIG_KEYS), _VALUES)}),
    st.dictionaries(st.text(max_size=8), _VALUES, max_size=4),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_SUITE)
def test_random_tables_only_raise_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "prompts").mkdir()
        (folder / "prompts" / "p.toml").write_text(PROMPTS)
        (folder / "prompts" / "q.toml").write_text('[[prompt]]\nid = "q"\ntext = "other"\n')
        try:
            suite = lang.parse_suite(data, path=folder / "s.toml")
        except ConfigError as exc:
            assert len(exc.message.splitlines()) == 1, exc.message
        else:
            for case in suite.cases.values():
                lang.config_digest(case)
                for ref in case.references:
                    lang.config_delta(case, suite.cases[ref])


_VALID = (HEAD + CHAIN).encode()


@settings(max_examples=300, deadline=None)
@given(raw=st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    # a valid suite with a random slice replaced: reaches the validator, not only the parser
    st.tuples(st.integers(0, len(_VALID)), st.integers(0, 40), st.binary(max_size=12)).map(
        lambda t: _VALID[: t[0]] + t[2] + _VALID[t[0] + t[1]:]),
))
def test_random_text_only_raises_config_error(raw):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "prompts").mkdir()
        (folder / "prompts" / "p.toml").write_text(PROMPTS)
        (folder / "s.toml").write_bytes(raw)
        try:
            suite = lang.load_suite(folder / "s.toml")
        except ConfigError as exc:
            assert len(exc.message.splitlines()) == 1, exc.message
        else:
            for case in suite.cases.values():
                lang.config_digest(case)

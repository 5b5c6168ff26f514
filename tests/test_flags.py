"""Every flag is defined once, on its ServerArgs field, and everything else is derived from it."""

from __future__ import annotations

import os
import re

import msgspec
import pytest

from tests.helpers import REPO_ROOT, smollm2_gguf
from trident.engine import parse_engine_flags
from trident.flags import FLAGS_DOC, build_parser, derived_fields, flag_fields, flag_values, flags_doc
from trident.foreign_flags import log_foreign_flags
from trident.launch import UsageError, server_args_from_cli
from trident.wire.server_args import ServerArgs


def a_value_other_than_the_default(field) -> object:
    if field.flag.choices:
        return next(c for c in reversed(field.flag.choices) if c != field.default)
    if field.type is bool:
        return not field.default
    if field.type is int:
        return (field.default or 0) + 3
    if field.type is float:
        return (field.default or 0.0) + 0.25
    if field.json_kind is dict:
        return {"value": field.name}
    if field.json_kind is list:
        return ["value-" + field.name]
    return "value-" + field.name


def test_every_server_args_field_is_a_flag_with_help_or_derived_by_launch():
    flags = {f.name for f in flag_fields()}
    derived = set(derived_fields())
    every_field = {f.name for f in msgspec.structs.fields(ServerArgs)}
    assert flags | derived == every_field and not flags & derived
    # Launch computes these six; a new field must be a flag unless it is one of them.
    assert derived == {
        "run_dir",
        "dist_init_host",
        "dist_init_port",
        "cluster_secret",
        "served_model_aliases",
        "sampling_defaults",
    }
    help_text = build_parser().format_help()
    for f in flag_fields():
        assert f.flag.help.strip(), f.name
        for name in f.names:
            assert name in help_text, name


def test_docs_flags_md_is_the_generated_one():
    with open(FLAGS_DOC) as fh:
        assert fh.read() == flags_doc(), "run `python -m trident.flags --write-docs`"
    for f in flag_fields():
        assert f"`{f.names[0]}`" in flags_doc()


def test_help_text_says_what_a_flag_does_not_what_it_measured():
    """Timings and CPU names go stale and differ by host: docs/benchmarks.md holds them."""
    measurement = re.compile(r"tok/s|GB/s|GFLOP|\d\s?(ms|us|µs)\b|\d(\.\d+)?x\b|%|Zen|Xeon|Rapids|EPYC")
    for f in flag_fields():
        assert not measurement.search(f.flag.help), (f.name, f.flag.help)


@pytest.mark.parametrize(("doc", "max_lines"), [("README.md", 150), ("docs/benchmarks.md", 400)])
def test_the_front_page_and_the_benchmarks_stay_short(doc, max_lines):
    """A newcomer reads the README in two minutes; benchmarks.md holds current figures, git the history."""
    with open(os.path.join(REPO_ROOT, doc)) as fh:
        lines = fh.read().splitlines()
    assert len(lines) <= max_lines, f"{doc} has {len(lines)} lines, at most {max_lines}"


@pytest.mark.parametrize("field", flag_fields(), ids=lambda f: f.name)
def test_engine_accepts_every_flag_by_its_field_name(field):
    value = a_value_other_than_the_default(field)
    if field.name == "model_path":
        ns = parse_engine_flags(str(value), {})
    else:
        ns = parse_engine_flags(None, {field.name: value})
    assert getattr(ns, field.name) == ([value] if field.flag.several else value)


def test_cli_spellings_and_defaults_are_unchanged(tmp_path):
    parser = build_parser()
    assert parser.parse_args(["--model-path", "m.gguf"]).model_path == "m.gguf"
    assert parser.parse_args(["--compile"]).compile_decode == "on"
    assert parser.parse_args(["--disable-compile"]).compile_decode == "off"
    assert parser.parse_args(["--sim-exact-steps"]).sim_step_spread is False
    assert parser.parse_args(["--startup-timeout", "7"]).startup_timeout_s == 7.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile", "--disable-compile"])
    ns = parser.parse_args(["--dist-init-addr", "10.0.0.1:5000", "--record-batches", "rec.bin"])
    model = smollm2_gguf()  # launch reads the model's recommended sampling: it names none
    args = server_args_from_cli(ns, model, "m", str(tmp_path))
    assert (args.dist_init_host, args.dist_init_port) == ("10.0.0.1", 5000)
    assert args.record_batches == os.path.abspath("rec.bin") and args.served_model_name == "m"
    assert args.served_model_aliases == ()
    named = server_args_from_cli(parser.parse_args(["--served-model-name", "a", "b", "c"]), model, "m", "/r")
    assert (named.served_model_name, named.served_model_aliases) == ("a", ("b", "c"))
    defaults = server_args_from_cli(parser.parse_args([]), model, "m", str(tmp_path))
    assert defaults.sampling_defaults == {}
    for f in flag_fields():
        if f.flag.default_text is None and f.flag.env is None:
            assert getattr(defaults, f.name) == f.default, f.name


def test_vllm_and_sglang_spellings_set_the_same_fields():
    """A vLLM or SGLang command line works unchanged (`trident serve MODEL` takes the model
    first, as `vllm serve` does: .ci/wheel_check.py starts the installed command so)."""
    parser = build_parser()
    vllm = parser.parse_args(
        ["--max-model-len", "2048", "--tensor-parallel-size", "2", "--data-parallel-size", "3", "--max-num-seqs", "8"]
        + ["--enforce-eager", "--no-enable-prefix-caching", "--generation-config", "vllm"]
    )
    ours = parser.parse_args(
        ["--context-length", "2048", "--tp-size", "2", "--dp-size", "3", "--max-running-requests", "8"]
        + ["--disable-cuda-graph", "--disable-radix-cache", "--generation-config", "vllm"]
    )
    assert vars(vllm) == vars(ours)
    assert vars(parser.parse_args(["-tp", "2", "-dp", "3"])) == vars(parser.parse_args(["--tp", "2", "--dp", "3"]))
    assert parser.parse_args(["--enable-prefix-caching"]).disable_radix_cache is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--enable-prefix-caching", "--no-enable-prefix-caching"])


@pytest.mark.parametrize("value", ["{", "[1]", '"text"'])
def test_a_json_object_flag_refuses_anything_else(value):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--override-generation-config", value])
    ns = build_parser().parse_args(["--override-generation-config", '{"temperature": 0.5}'])
    assert ns.override_generation_config == {"temperature": 0.5}


def test_other_engines_flags_are_accepted_with_no_effect_or_refused_naming_ours(capsys, caplog):
    parser = build_parser()
    ns = parser.parse_args(["--trust-remote-code", "--enable-auto-tool-choice", "--disable-log-requests"])
    assert flag_values(ns) == flag_values(parser.parse_args([])), "they change no setting"
    with caplog.at_level("INFO", logger="trident.launch"):
        log_foreign_flags(ns)
    assert "--trust-remote-code (vLLM, SGLang's flag) has no effect: no code from a checkpoint runs" in caplog.text
    assert "--enable-auto-tool-choice" in caplog.text and "--disable-log-requests" in caplog.text
    for refused, ours in [
        (["--gpu-memory-utilization", "0.9"], "--mem-fraction"),
        (["--max-num-batched-tokens", "8192"], "--max-prefill-tokens"),
        (["--kv-cache-dtype", "fp8"], "--dtype"),
        (["--quantization", "awq"], "--weight-dtype gguf"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(refused)
        error = capsys.readouterr().err
        assert f"{refused[0]} is vLLM" in error and ours in error, error


def test_vllms_speculative_config_sets_our_speculative_flags():
    parser = build_parser()
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}'
    theirs = parser.parse_args(["--speculative-config", config])
    ours = parser.parse_args(
        ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3"]
        + ["--speculative-ngram-min", "1", "--speculative-ngram-max", "5"]
    )
    assert flag_values(theirs) == flag_values(ours)
    for bad in (
        '{"method": "eagle"}',
        '{"method": "ngram", "draft_model": "x"}',
        '{"method": "ngram", "num_speculative_tokens": 2.5}',
        "[]",
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
    with pytest.raises(UsageError, match="need 1 <= min <= max"):
        server_args_from_cli(parser.parse_args(["--speculative-ngram-min", "5"]), smollm2_gguf(), "m", "/r")

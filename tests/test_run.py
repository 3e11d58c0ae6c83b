"""`python -m mixserve.run`: the default job, the JSON report, hybrid weights and --help."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mixserve import run
from mixserve.tokenizer import ByteTokenizer
from conftest import host_devices_env


def test_default_run_reports_fp8_capacity_and_serves_everything(capsys):
    report = run.main(["--json", "--max-new-tokens", "3"])
    out = json.loads(capsys.readouterr().out)
    assert out["random_weights"] is True and out["kv_cache_dtype"] == "fp8_e4m3" and out["integrity"] == "check"
    assert out["kv_scales"] == "1"  # a preset ships no calibrated scales
    assert [r["status"] for r in report["requests"]] == ["ok"] * len(run.DEFAULT_PROMPTS)
    assert all(len(r["tokens"]) == 3 for r in report["requests"])
    cap = report["pool_tokens_at_same_memory"]
    assert cap["fp8_e4m3"] >= 1.98 * cap["bfloat16"]
    assert len(report["weight_sets"]) == 1
    lat, reqs = out["latency_s"], report["requests"]  # per request: the median and p99 of what each reports
    assert lat["ttft"]["p50"] == pytest.approx(np.median([r["ttft_s"] for r in reqs]), rel=1e-12) and lat["queue"]["p99"] <= lat["ttft"]["p99"]
    assert lat["ttft"]["p99"] <= max(r["ttft_s"] for r in reqs) and lat["inter_token"]["p50"] > 0


@pytest.mark.parametrize("decode, shown", [("int4", "experts=int4-g32"), ("nvfp4", "experts=nvfp4")])
def test_hybrid_fp8_prefill_4bit_decode_holds_two_weight_sets(capsys, decode, shown):
    report = run.main(["--prefill-weights", "fp8", "--decode-weights", decode, "--max-new-tokens", "2",
                       "--prompt", "hello", "--kv-cache-dtype", "bfloat16", "--integrity", "off"])
    text = capsys.readouterr().out
    assert "two weight sets on one device" in text
    (prefill_plan, *_), (decode_plan, *_) = report["weight_sets"]["prefill"], report["weight_sets"]["decode"]
    assert "fp8_block" in prefill_plan and shown in decode_plan
    assert report["requests"][0]["status"] == "ok"


def test_sampling_flags_reach_the_engine_and_the_drawn_seed_repeats_a_run(capsys):
    # top_k past the vocabulary (and int32) keeps every token; with a drawn seed a request may
    # sample an end token, which --ignore-eos lets pass so that each yields all 4
    flags = ["--max-new-tokens", "4", "--temperature", "1.5", "--top-k", str(2**40), "--min-p", "0.01",
             "--integrity", "off", "--ignore-eos"]
    drawn = run.main(["--json", *flags])
    seed = drawn["sampling"]["seed"]
    capsys.readouterr()
    # Text output, past the default max_logprobs
    again = run.main([*flags, "--seed", str(seed), "--logprobs", "21", "--prompt-logprobs", "2"])
    out = capsys.readouterr().out
    assert f"sampling: temperature 1.5, top_p 1.0, top_k {2**40}, min_p 0.01, seed {seed} " in out
    greedy = run.main(["--json", "--max-new-tokens", "4", "--integrity", "off"])
    capsys.readouterr()
    tokens = lambda report: [r["tokens"] for r in report["requests"]]
    assert again["sampling"] == {"temperature": 1.5, "top_p": 1.0, "top_k": 2**40, "min_p": 0.01, "seed": seed,
                                 "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                 "structured_output": None}
    assert "penalties:" not in out
    assert tokens(again) == tokens(drawn) != tokens(greedy)
    assert all(r["logprobs"] is None and r["prompt_logprobs"] is None for r in drawn["requests"])
    for r in again["requests"]:  # logprobs, ranks and the 21 likeliest of each sampled token
        ranks = [lp["rank"] for lp in r["logprobs"]]
        assert len(ranks) == 4 and all(len(lp["top"]) == 21 for lp in r["logprobs"]) and f"ranks {ranks}" in out
        assert all(lp["top"][0][1] >= lp["logprob"] for lp in r["logprobs"])
        first, *rest = r["prompt_logprobs"]  # and each prompt token's after the first, with its 2 likeliest
        assert first is None and len(rest) == r["prompt_tokens"] - 1 and all(len(lp["top"]) == 2 for lp in rest)
        mean = sum(lp["logprob"] for lp in rest) / len(rest)
        assert f"prompt: mean logprob {mean:.3f}" in out and f"over its last {len(rest)} tokens" in out


def test_ignore_eos_runs_past_the_models_end_token(monkeypatch):
    """Make the token greedy decoding emits second the preset's end token: without --ignore-eos the
    first request ends there, with it the run repeats the free tokens."""
    import dataclasses
    from models import presets
    flags = ["--json", "--max-new-tokens", "4", "--integrity", "off", "--prompt", "hello"]
    free = run.main(flags)["requests"][0]
    end = free["tokens"][1]
    cfg = dataclasses.replace(presets.PRESETS[run.DEFAULT_MODEL], eos_token_ids=(end,))
    monkeypatch.setitem(presets.PRESETS, run.DEFAULT_MODEL, cfg)
    ended = run.main(flags)["requests"][0]
    stop_at = free["tokens"].index(end) + 1
    assert ended["tokens"] == free["tokens"][:stop_at] and ended["stop_reason"] == end
    assert run.main([*flags, "--ignore-eos"])["requests"][0]["tokens"] == free["tokens"]


def test_stop_strings_cut_each_request_at_the_first_one(capsys):
    """--stop: the tiny presets' text is UTF-8 bytes; each request ends at the first token after
    which its decoded output holds the stop string, and its text is cut before the string."""
    flags = ["--json", "--max-new-tokens", "8", "--integrity", "off"]
    free = run.main(flags)
    stop = next(c for c in free["requests"][0]["text"] if c.isascii() and c.isprintable())
    cut = run.main([*flags, "--stop", stop])
    capsys.readouterr()
    run.main(flags[1:] + ["--stop", stop])  # text: says what stopped a request
    assert f"(stopped by {stop!r})" in capsys.readouterr().out
    byte_text = ByteTokenizer().decode
    for f, c in zip(free["requests"], cut["requests"], strict=True):
        end = next((k for k in range(1, 9) if stop in byte_text(f["tokens"][:k])), 8)
        assert c["tokens"] == f["tokens"][:end] and c["stop_reason"] == (stop if stop in f["text"] else None)
        assert c["text"] == f["text"].split(stop)[0] if stop in f["text"] else c["text"] == f["text"]


def test_structured_output_flags_hold_every_output_and_are_reported(capsys, tmp_path):
    """--choice (repeated) and --json-schema from a file: the tiny presets' text is UTF-8 bytes,
    so each output is one of the choices, or JSON of the schema, ending on the end token; the
    report holds the structure, and the printed text shows it though the weights are random."""
    flags = ["--json", "--max-new-tokens", "12", "--integrity", "off", "--temperature", "1"]
    choices = ["yes", "no", "maybe"]
    picked = run.main([*flags, *(f for c in choices for f in ("--choice", c))])
    assert list(picked["sampling"]["structured_output"]["choice"]) == choices and picked["grammar_mask_s"] > 0
    assert all(r["text"] in choices and r["stop_reason"] is not None for r in picked["requests"])
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                  "required": ["n"], "additionalProperties": False,
                                  "x-guidance": {"whitespace_flexible": False}}))
    filled = run.main([*flags, "--json-schema", str(schema)])
    assert filled["sampling"]["structured_output"]["json_schema"]["required"] == ["n"]
    for r in filled["requests"]:
        assert r["stop_reason"] is not None and 0 <= json.loads(r["text"])["n"] <= 9  # {"n":D} in 12 tokens
    capsys.readouterr()
    run.main(flags[1:] + ["--choice", "yes"])
    assert "prompt tokens -> 'yes' (stopped by" in capsys.readouterr().out


def test_json_report_writes_nan_and_infinities_as_null():
    """Strict JSON has no NaN: a model whose logits overflow would otherwise print an unreadable report."""
    report = {"logprob": float("nan"), "top": [(3, float("-inf")), (4, -1.5)], "ok": True, "n": 2}
    assert json.loads(json.dumps(run.finite_or_null(report), allow_nan=False)) == {
        "logprob": None, "top": [[3, None], [4, -1.5]], "ok": True, "n": 2}


def test_help_explains_each_flag():
    out = subprocess.run([sys.executable, "-m", "mixserve.run", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--model", "--kv-cache-dtype", "--integrity", "--page-size", "--kv-memory", "--max-new-tokens",
                 "--prompt", "--concurrency", "--json", "--prefill-weights", "--decode-weights", "--backend",
                 "--max-seq-len", "--disaggregate", "--prefill-kv-cache-dtype", "--logprobs", "--min-p", "--prompt-logprobs", "--stop"):
        assert flag in out


def test_backend_flag_reaches_the_kernels(capsys):
    """--backend interpret runs the Pallas kernels (MLA decode, INT4 expert matmuls) and serves the
    same greedy tokens as the XLA references; --backend auto is xla on a machine without a GPU."""
    args = ["--json", "--decode-weights", "int4", "--max-new-tokens", "3", "--prompt", "KV cache pages",
            "--prompt", "FP8"]
    kernels = run.main([*args, "--backend", "interpret"])
    auto = run.main(args)
    capsys.readouterr()
    assert kernels["backend"] == "interpret" and auto["backend"] == "xla"
    assert [r["tokens"] for r in kernels["requests"]] == [r["tokens"] for r in auto["requests"]]


def test_max_seq_len_rejects_only_the_request_that_exceeds_it(capsys):
    report = run.main(["--json", "--max-seq-len", "12", "--max-new-tokens", "4", "--prompt", "12345678",
                       "--prompt", "123456789"])
    capsys.readouterr()
    assert report["max_seq_len"] == 12
    ok, rejected = report["requests"]
    assert ok["status"] == "ok" and len(ok["tokens"]) == 4
    assert rejected["status"] == "rejected" and "13 exceeds the context limit 12" in rejected["reason"]


def test_disaggregate_puts_prefill_and_decode_on_devices_of_their_own():
    """Four simulated CPU devices, tensor parallel 2 on each side: prefill on devices 0-1, decode
    on 2-3, tiny-glm4's KV heads split over each pair, so pages move between two shardings. With
    the same KV format on both sides the pages move unchanged: the tokens are one device's."""
    script = (
        "import json; from mixserve import run\n"
        "args = ['--json', '--model', 'tiny-glm4', '--max-new-tokens', '4', '--prefill-chunk', '8']\n"
        "pair = run.main(args + ['--disaggregate', '--tensor-parallel', '2', '--prefill-kv-cache-dtype', 'fp8_e4m3'])\n"
        "one = run.main(args)\n"
        "split = pair['kv_bytes_per_token'] // pair['kv_bytes_per_token_per_device']\n"
        "try:\n"  # 2 x 3 devices of 4: a usage error, not both engines on devices 0-2
        "    run.main(args + ['--disaggregate', '--tensor-parallel', '3'])\n"
        "except SystemExit as e:\n"
        "    refused = e.code\n"
        "print('RESULT', json.dumps([pair['disaggregated'], [r['tokens'] for r in pair['requests']],\n"
        "                            [r['tokens'] for r in one['requests']], split, refused]))\n")
    env = host_devices_env(4)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    where, pair_tokens, one_tokens, split, refused = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert refused == 2 and "devices [3, 6): 4 devices available" in out.stderr
    assert split == 2  # each decode device holds one of the two KV heads
    assert where["prefill_devices"] == ["cpu:0", "cpu:1"] and where["decode_devices"] == ["cpu:2", "cpu:3"]
    assert where["handover"]["handovers"] == len(run.DEFAULT_PROMPTS) and where["handover"]["bytes_sent"] > 0
    assert where["prefill_counters"]["decode_tokens"] == 0
    assert pair_tokens == one_tokens


def test_bad_flag_values_are_usage_errors_not_tracebacks(capsys):
    """Each value is refused by argparse or by the model/engine, and reported as `error: ...`
    (exit status 2), never as a traceback; so is a flag that would change nothing."""
    cases = {
        ("--kv-memory", "abc"): "not a memory size: 'abc'",
        ("--kv-memory", "-5"): "must be positive",
        ("--page-size", "0"): "--page-size: must be at least 1, got 0",
        ("--tensor-parallel", "0"): "--tensor-parallel: must be at least 1",
        ("--prefill-calls-per-step", "-1"): "must be at least 0, got -1",
        ("--model", "no-such-model"): "'no-such-model' is neither a checkpoint directory (no such directory) nor a "
                                      "preset; the presets a model is made from: tiny-glm4, tiny-glm5, tiny-kimi",
        ("--model", __file__): "is neither a checkpoint directory (a file, not a directory)",
        ("--model", "tiny-glm4", "--kv-cache-dtype", "fp8_ds_mla"): "fp8_ds_mla is FlashMLA's layout",
        ("--kv-memory", "1k"): "the KV budget holds no page",
        ("--kv-memory", "1e30"): "the page table holds at most 2**31 - 1",
        ("--tensor-parallel", "16"): "devices [0, 16): ",
        ("--temperature", "-1"): "need temperature >= 0",
        ("--top-p", "0"): "0 < top_p <= 1",
        ("--seed", str(2**63)): "seed must be an integer in [-2**63, 2**63)",
        ("--repetition-penalty", "0"): "need repetition_penalty > 0",
        ("--presence-penalty", "2.5"): "presence_penalty in [-2, 2]",
        ("--frequency-penalty", "nan"): "frequency_penalty must be a finite number",
        ("--stop", ""): "stop must be a list of non-empty strings",
        ("--logprobs", "1000"): "logprobs must be None or an integer in [0, max_logprobs=320], got 1000",
        ("--max-new-tokens", "512"): "--max-new-tokens 512 leaves no room for a prompt within the context limit 512",
        # flags that would change nothing as the others stand
        ("--expert-parallel",): "--expert-parallel splits over the --tensor-parallel devices",
        ("--prefill-kv-cache-dtype", "fp8_e4m3"): "--prefill-kv-cache-dtype is the prefill engine's pool under --disaggregate",
        ("--draft", "ngram"): "--draft says who guesses the --speculative-tokens",
        ("--regex", "a(b"): "unclosed group",
        ("--json-schema", "{not json"): "--json-schema: Expecting property name",
        ("--json-schema", "/no/such/schema.json"): "/no/such/schema.json: no such file (nor is it inline: Expecting value",
        ("--regex", "a", "--choice", "a"): "exactly one of",
        ("--json-object", "--ignore-eos"): "ignore_eos",
        ("--json-schema", "false"): "Unsatisfiable schema",  # a schema nothing fits, not "no schema"
        ("--host-kv-memory", "0"): "must be positive",
        ("--host-kv-memory", "1MiB", "--no-prefix-caching"): "host_kv_bytes is the prefix cache's host tier",
    }
    for argv, message in cases.items():
        try:
            run.main(["--max-new-tokens", "1", "--prompt", "a", *argv])
        except SystemExit as exit_:
            assert exit_.code == 2, argv
        else:
            raise AssertionError(f"{argv} was accepted")
        assert message in capsys.readouterr().err, argv
    assert run.parse_memory("1e6") == 10**6 and run.parse_memory("4MiB") == 4 << 20


def test_a_budget_too_small_for_one_bf16_page_still_reports(capsys):
    """3000 bytes hold one FP8 page of tiny-kimi (120 B/token x 16) and no BF16 page: the
    capacity comparison says so instead of dividing by zero."""
    report = run.main(["--kv-memory", "3000", "--max-new-tokens", "2", "--prompt", "a"])
    text = capsys.readouterr().out
    assert report["pool_tokens_at_same_memory"]["bfloat16"] == 0 and report["requests"][0]["status"] == "ok"
    assert "BF16 KV holds no page at this memory" in text


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_speculative_flags_keep_the_greedy_tokens(capsys, draft):
    """--speculative-tokens with either draft: the tokens of a plain run (a preset gets a random MTP
    layer), the drafts counted in the report; with --disaggregate too."""
    flags = ["--json", "--max-new-tokens", "8", "--model", "tiny-glm5"]
    plain = run.main(flags)
    for extra in ([], ["--disaggregate"]):
        spec = run.main([*flags, *extra, "--speculative-tokens", "2", "--draft", draft])
        assert [r["tokens"] for r in spec["requests"]] == [r["tokens"] for r in plain["requests"]]
        assert spec["speculative"] == {"tokens": 2, "draft": draft}
        assert spec["counters"]["verified_rows"] > 0
    capsys.readouterr()


def test_host_kv_memory_brings_back_an_evicted_prompt():
    """One request at a time through a pool of 8 pages: the fourth prompt is the first again, whose
    pages the two between evicted. With --host-kv-memory they come back from host memory (its
    full pages: 6 of 16 tokens), and every request's tokens are those of the run without it."""
    prompts = [chr(65 + i) * 3 + " prompt %d " % i * 9 for i in range(3)]
    argv = ["--json", "--model", "tiny-kimi", "--concurrency", "1", "--page-size", "16", "--kv-memory",
            str(8 * 16 * 120), "--max-new-tokens", "4", *[a for p in prompts + prompts[:1] for a in ("--prompt", p)]]
    plain = run.main(argv)
    hosted = run.main(argv + ["--host-kv-memory", "1MiB"])
    assert [r["tokens"] for r in hosted["requests"]] == [r["tokens"] for r in plain["requests"]]
    assert plain["requests"][-1]["cached_tokens"] == 0 and plain["counters"]["evicted_pages"] > 0
    full_pages = (len(ByteTokenizer().encode(prompts[0])) - 1) // 16
    assert hosted["requests"][-1]["cached_tokens"] == hosted["counters"]["host_restored_tokens"] == 16 * full_pages


def test_skip_special_tokens_is_on_unless_the_flag_turns_it_off():
    """--no-skip-special-tokens keeps the tokenizer's special tokens in the text (vLLM's default
    leaves them out); the text path itself is tested through the server and Request."""
    for flags, skip in (((), True), (("--no-skip-special-tokens",), False)):
        args = run.build_parser().parse_args(list(flags))
        args.structured_output = None  # main sets it from the structured-output flags
        assert run.request_options(args)["skip_special_tokens"] is skip, flags

"""`python -m mixserve.run`: serve a handful of prompts and report what the KV cache format buys.

With no arguments it serves the embedded default model, a tiny preset with random weights (until
a trained default model exists: its text is noise, and the output says so), with FP8 KV and the
integrity check on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import numpy as np

import mixserve
import pallas_kernels
from mixserve import sharding
from mixserve.chat import ChatTemplateError
from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine
from mixserve.gptq import abstract_params
from mixserve.grammar import StructuredOutput
from mixserve.kv_cache import KV_CACHE_DTYPES, TILED, kv_format
from mixserve.model import Model
from mixserve.model_runner import LOGPROBS_MODES
from mixserve.quantize import first_without_effect, plan_for, quantize_model
from mixserve.scheduler import SCHEDULE_POLICIES
from mixserve.replies import ReplyFormat, ReplyParser
from mixserve.tokenizer import ByteTokenizer, text_tokenizer
from models.presets import TINY_PRESETS
from models.weights import WeightFormat

DEFAULT_MODEL = "tiny-kimi"
WEIGHT_CHOICES = {
    "model": None,
    "fp8": plan_for(WeightFormat("fp8_block"), "all"),
    "int4": plan_for(WeightFormat("int4", 32), "experts"),
    "nvfp4": plan_for(WeightFormat("nvfp4"), "experts"),
}
DEFAULT_PROMPTS = ["The cheapest token is the one", "KV cache pages", "FP8 e4m3 has no infinity", "Hello"]


def parse_memory(text: str) -> int:
    """'4MiB', '1GiB', '512k', '1e6' -> bytes; argparse reports anything else as a usage error."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    number, scale = (t[:-1], units[t[-1]]) if t and t[-1] in units else (t, 1)
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 4MiB, 1GiB or a number of bytes)")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def counted(least: int):
    """An argparse type: an integer >= least."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mixserve.run", description=__doc__.split("\n\n")[0])
    add_engine_flags(p)
    add_request_flags(p)
    p.add_argument("--json", action="store_true", help="print a machine-readable report instead of text")
    return p


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags that load the model and build the engine (mixserve.server takes them too)."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"checkpoint directory or preset name (default {DEFAULT_MODEL}, random weights)")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=KV_CACHE_DTYPES,
                   help="KV pool storage (SGLang/vLLM names); auto = the model dtype; fp8_ds_mla (MLA models): "
                        "FlashMLA's layout, e4m3 with a scale per token and 128-column tile, RoPE part in BF16")
    p.add_argument("--integrity", default="check", choices=["off", "check", "strict"],
                   help="KV page-tag check in every prefill and decode call: off (no-op), check (abort the bad request), "
                        "strict (abort it, then raise)")
    p.add_argument("--page-size", type=counted(1), default=16, help="tokens per KV page")
    p.add_argument("--kv-memory", type=parse_memory, default="4MiB", help="KV pool budget, e.g. 4MiB, 1GiB, or bytes")
    p.add_argument("--max-seq-len", type=counted(1), help="context limit per request, prompt + generated tokens "
                   "(SGLang's --context-length, vLLM's --max-model-len); default and maximum: the model's "
                   "max_position_embeddings. Longer requests are rejected, each with its reason")
    p.add_argument("--concurrency", type=counted(1), default=4, help="maximum requests decoded together (the batch)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt whole: no KV pages kept past their requests or shared by equal prefixes")
    p.add_argument("--host-kv-memory", type=parse_memory, default=0,
                   help="the prefix cache's host tier (SGLang's HiCache, vLLM's CPU offload): host memory that keeps "
                        "the KV pages evicted from the pool, e.g. 64MiB, for a later equal prefix to copy back instead of "
                        "prefilling; default: none. With --disaggregate, the prefill engine's")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="return the experts each MoE layer chose for every token fed to the model (vLLM's flag, for "
                        "an RL trainer's routing replay): --json's routed_experts, the server's prompt_routed_experts "
                        "and routed_experts")
    p.add_argument("--enable-return-indexer-topk", action="store_true",
                   help="GLM-5: return the positions each DSA indexer layer let every token fed to the model attend to "
                        "(SGLang's flag, for an RL trainer's indexer replay): --json's indexer_topk, the server's "
                        "prompt_indexer_topk and indexer_topk")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=list(LOGPROBS_MODES),
                   help="what a request's logprobs are of (vLLM's flag): the model's raw distribution, or the one "
                        "each token was drawn from (processed: temperature, min-p, top-k, top-p, logit bias, "
                        "penalties, structured output; what they left out at -inf), as logprobs or logits. "
                        "Prompt logprobs are the raw log-probabilities in every mode, as vLLM's")
    p.add_argument("--schedule-policy", default="fcfs", choices=list(SCHEDULE_POLICIES),
                   help="admission order of waiting requests: first come, first served, the longest cached "
                        "prefix first (SGLang's lpm; first come, first served past 128 waiting), or each request's "
                        "priority, lower first, which also preempts the highest first (vLLM's; the server's "
                        "`priority` field: this command's prompts all have 0)")
    p.add_argument("--prefill-chunk", type=counted(1), default=64, help="most tokens of one request per prefill call")
    p.add_argument("--prefill-calls-per-step", type=counted(0), default=1,
                   help="prefill calls per engine step before its decode step (chunked prefill: running requests "
                        "decode between a long prompt's chunks); 0 = no limit, each prompt prefills fully first")
    p.add_argument("--tensor-parallel", type=counted(1), default=1,
                   help="devices to split the weights and KV heads over (mesh axis 'model'; the KV budget is per "
                        "device). On CPU it simulates them (XLA's host device count)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="split the routed experts by expert over the --tensor-parallel devices (E/n whole experts each) "
                        "instead of by hidden width; attention stays tensor parallel")
    p.add_argument("--decode-context-parallel", action="store_true",
                   help="MLA models: split every KV page's slots over the --tensor-parallel devices (each holds 1/n of "
                        "the latent pool: n times the tokens); decode attention runs all heads over each device's "
                        "share and merges")
    p.add_argument("--prefill-weights", default="model", choices=list(WEIGHT_CHOICES),
                   help="weights prefill runs on: model (as loaded), fp8 (128x128 block, all linear layers), "
                        "int4 (group 32, routed experts; RTN), nvfp4 (4-bit floats, e4m3 scales per 16, routed "
                        "experts; RTN)")
    p.add_argument("--decode-weights", default="model", choices=list(WEIGHT_CHOICES),
                   help="weights decode runs on (the seed: FP8 prefill, INT4 decode); a second weight set if it differs")
    p.add_argument("--disaggregate", action="store_true",
                   help="serve as the seed deploys: a prefill engine (--prefill-weights, --prefill-kv-cache-dtype pages) "
                        "hands each prompt's KV pages to a decode engine (--decode-weights, --kv-cache-dtype pages), each "
                        "on --tensor-parallel devices of its own (2 x that many are needed; a machine with one device "
                        "runs both on it), each with the --kv-memory budget")
    p.add_argument("--prefill-kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="the prefill engine's KV pool with --disaggregate (default bfloat16, as the seed: prefill is "
                        "compute-bound); pages are converted to the decode pool's format as they are handed over")
    p.add_argument("--nvfp4-activations", action="store_true",
                   help="a W4A4 NVFP4 checkpoint (ModelOpt, llm-compressor NVFP4): quantize each NVFP4 layer's input "
                        "under its calibrated scale, as Blackwell's FP4 tensor cores compute it; by default NVFP4 is "
                        "served weight-only (W4A16), as on Hopper")
    p.add_argument("--speculative-tokens", type=counted(0), default=0,
                   help="speculative decoding: each decode step verifies up to this many guessed tokens (--draft); "
                        "greedy output is unchanged, sampled output keeps its distribution")
    p.add_argument("--draft", choices=["mtp", "ngram"],
                   help="who guesses the --speculative-tokens: mtp (default), the checkpoint's MTP layer "
                        "(GLM-4.5/GLM-5/DeepSeek-V3 ship one; a tiny preset gets a random one, whose guesses are "
                        "mostly rejected), or ngram: the tokens that followed the request's last tokens earlier in its "
                        "text (any model, Kimi included)")
    p.add_argument("--backend", default="auto", choices=["auto", *pallas_kernels.BACKENDS],
                   help="kernels for paged decode attention and INT4/NVFP4 matmuls: pallas (GPU), xla (the jnp references), "
                        "interpret (the Pallas kernels in the interpreter, slow; for CPU checks); auto = pallas on GPU, else xla")


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """What every prompt of `mixserve.run` is served with (a server's requests say it themselves)."""
    p.add_argument("--max-new-tokens", type=counted(1), default=16, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); else sample at this temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of likeliest tokens with this mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 or -1: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the likeliest")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="divide (positive) or multiply (negative) "
                   "the logits of the prompt's and output's tokens by this (> 0; 1 = off), greedy included (vLLM's)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this from a token's logit for each "
                   "time the output holds it (in [-2, 2])")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtract this once from the logit of a token "
                   "the output holds (in [-2, 2])")
    p.add_argument("--json-schema", help="hold each output to this JSON schema: inline JSON, or a file holding it "
                   "(structured outputs; the output ends on an end token once the schema is complete)")
    p.add_argument("--json-object", action="store_true", help="hold each output to a JSON object")
    p.add_argument("--regex", help="hold each output to this regular expression (Rust's regex syntax, whole output)")
    p.add_argument("--choice", action="append", help="hold each output to one of these strings (repeatable)")
    p.add_argument("--grammar", help="hold each output to this Lark grammar (llguidance's dialect): text, or a file")
    p.add_argument("--seed", type=int, help="sampling seed (default: drawn, and reported, so a run can be repeated)")
    p.add_argument("--logprobs", type=counted(0), help="report each generated token's log-probability and rank, "
                   "and this many likeliest tokens (the model's distribution, before sampling)")
    p.add_argument("--prompt-logprobs", type=counted(0), help="the same for each prompt token after the first, "
                   "as the engine's prefill computes them (KV format included): the prompts' perplexity")
    p.add_argument("--stop", action="append", help="a stop string (repeatable): a request ends once its output "
                   "contains one, and its text is cut before it")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens per prompt: the model's end tokens "
                   "do not end a request (a benchmark's fixed output length)")
    p.add_argument("--min-tokens", type=counted(0), default=0, help="tokens a request generates before a stop token "
                   "or stop string may end it (vLLM's min_tokens)")
    p.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="the text leaves out the tokenizer's special tokens, but the <think> a --chat reply is "
                   "read for (vLLM's skip_special_tokens; the tokens keep them)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); text if the model has a tokenizer, else bytes")
    p.add_argument("--chat", action="store_true", help="each prompt is a user's message, rendered through the model's "
                   "chat template (ending with the assistant's header); its reply is read for <think> reasoning")


def with_weights(model, choice: str):
    """The model as loaded, or converted in memory (round to nearest) into the chosen format."""
    plan = WEIGHT_CHOICES[choice]
    if plan is None or plan == model.plan:
        return model
    return quantize_model(model, plan)[0]


def param_bytes(model) -> int:
    """Bytes of the model's weights as its plan stores them (a placed copy may hold re-blocked scales)."""
    abstract = abstract_params(model.config, model.plan, model.dtype, model.mtp_plan)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.max_logprobs = max(20, args.logprobs or 0, args.prompt_logprobs or 0)
    try:
        args.structured_output = structured_output(args)
    except json.JSONDecodeError as e:
        parser.error(f"--json-schema: {e}")
    except OSError as e:
        parser.error(str(e))
    backend, mesh, setup = start(parser, args, progress=not args.json)
    if args.max_new_tokens >= setup.decoder.max_seq_len:
        parser.error(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt within the context limit "
                     f"{setup.decoder.max_seq_len} (--max-seq-len)")
    # The sampling and stop flags are every request's: values no request may take are a usage error.
    if why := setup.engine.options_reason(**request_options(args)):
        parser.error(why)
    texts = args.prompt or DEFAULT_PROMPTS
    if args.chat:
        if setup.model.chat_template is None:
            parser.error(f"--chat renders prompts through the model's chat template, and {args.model} has none")
        try:
            texts = [setup.model.chat_template.render([{"role": "user", "content": t}], add_generation_prompt=True)
                     for t in texts]
        except ChatTemplateError as e:
            parser.error(f"--chat: {e}")
        if args.structured_output is not None:  # the reasoning is free (the prompts end alike: one template)
            fmt = ReplyFormat.detect(list(setup.model.chat_template.templates.values()))
            reply = ReplyParser.for_request(fmt, texts[0], None)
            args.structured_output = reply.hold_answer(args.structured_output, setup.model.tokenizer)
    return serve(args, backend, mesh, setup, texts)


def start(parser: argparse.ArgumentParser, args, progress: bool) -> tuple[str, object, Setup]:
    """From add_engine_flags' flags (and args.max_logprobs): the kernel backend, the (decode) mesh
    and the Setup, on as many (simulated, on CPU) devices as they ask for. A flag the model or
    engine refuses is the parser's usage error, not a traceback."""
    if why := flag_without_effect(args):
        parser.error(why)
    args.prefill_kv_cache_dtype = args.prefill_kv_cache_dtype or "bfloat16"
    args.draft = args.draft or "mtp"
    tp = args.tensor_parallel
    devices = tp * (2 if args.disaggregate else 1)
    if devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Read when JAX starts its CPU backend, so only before the first computation; GPUs ignore it.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={devices}").strip()
    backend = pallas_kernels.resolve_backend(args.backend)
    try:  # too few devices, a bad model, or a flag the model or engine refuses: a usage error, not a traceback
        if args.disaggregate and (tp > 1 or jax.device_count() > 1):  # prefill on devices [0, tp), decode on [tp, 2 tp)
            prefill_mesh, mesh = sharding.tp_mesh(tp), sharding.tp_mesh(tp, first=tp)
        else:  # one engine, or a pair sharing a machine's single device
            prefill_mesh = mesh = sharding.tp_mesh(tp) if tp > 1 else None
        setup = build(args, backend, prefill_mesh, mesh, progress)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    return backend, mesh, setup


def flag_without_effect(args) -> str | None:
    """Why a flag given would change nothing, as the others stand: a usage error, not dropped unsaid."""
    return first_without_effect((
            (args.expert_parallel, args.tensor_parallel > 1,
             "--expert-parallel splits over the --tensor-parallel devices: give 2 or more"),
            (args.decode_context_parallel, args.tensor_parallel > 1,
             "--decode-context-parallel splits over the --tensor-parallel devices: give 2 or more"),
            (args.prefill_kv_cache_dtype, args.disaggregate,
             "--prefill-kv-cache-dtype is the prefill engine's pool under --disaggregate; one engine's pool is "
             "--kv-cache-dtype"),
            (args.draft, args.speculative_tokens > 0,
             "--draft says who guesses the --speculative-tokens: give 1 or more")))


def request_options(args) -> dict:
    """The per-request options the flags give every prompt (Frontend.submit's keywords)."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
                min_tokens=args.min_tokens, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, structured_output=args.structured_output,
                skip_special_tokens=args.skip_special_tokens)


def structured_output(args) -> StructuredOutput | None:
    """What the --json-schema, --json-object, --regex, --choice and --grammar flags hold every output
    to (None: none given; several: the engine's usage error says so)."""
    given = dict(json_schema=None if args.json_schema is None else file_or_text(args.json_schema, json.loads),
                 regex=args.regex, choice=None if args.choice is None else tuple(args.choice),
                 grammar=None if args.grammar is None else file_or_text(args.grammar, str))
    if args.json_object or any(v is not None for v in given.values()):  # '{}' and '' are structures too
        return StructuredOutput(json_object=args.json_object, **given)
    return None


def file_or_text(arg: str, parse):
    """An argument that is a file's path (its content, parsed) or the text itself (parsed)."""
    if os.path.isfile(arg):
        with open(arg) as f:
            return parse(f.read())
    try:
        return parse(arg)
    except ValueError as e:  # json's errors among them
        if not arg.lstrip().startswith(("{", "[", '"')):  # not meant inline: a path whose file is missing
            raise OSError(f"{arg}: no such file (nor is it inline: {e})") from e
        raise


@dataclasses.dataclass
class Setup:
    """What main serves with: the model as loaded, its prefill and decode weight sets (the same
    object when one set serves both), and the engine with its prefilling and decoding parts."""
    model: Model
    prefill_model: Model
    decode_model: Model
    engine: Engine | DisaggregatedEngine
    prefiller: Engine
    decoder: Engine


def build(args, backend: str, prefill_mesh, mesh, progress: bool) -> Setup:
    """Load the model, convert its weight sets and build the engine, as the flags say."""
    model, prefill_model, decode_model = weight_sets(args, args.model, backend, prefill_mesh, progress)
    common = dict(page_size=args.page_size, kv_memory_bytes=args.kv_memory, max_batch=args.concurrency,
                  integrity=args.integrity, attention_backend=backend, max_seq_len=args.max_seq_len,
                  prefill_chunk=args.prefill_chunk, prefill_calls_per_step=args.prefill_calls_per_step or None,
                  expert_parallel=args.expert_parallel, max_logprobs=min(args.max_logprobs, model.config.vocab_size),
                  speculative_tokens=args.speculative_tokens, draft=args.draft, prefix_caching=not args.no_prefix_caching,
                  schedule_policy=args.schedule_policy, return_routed_experts=args.enable_return_routed_experts,
                  return_indexer_topk=args.enable_return_indexer_topk, logprobs_mode=args.logprobs_mode)
    if args.disaggregate:
        engine = DisaggregatedEngine(
            Engine(prefill_model, kv_dtype=args.prefill_kv_cache_dtype, mesh=prefill_mesh, prefill_only=True,
                   host_kv_bytes=args.host_kv_memory, **common),
            Engine(decode_model, kv_dtype=args.kv_cache_dtype, mesh=mesh, decode_context_parallel=args.decode_context_parallel,
                   **common))
        return Setup(model, prefill_model, decode_model, engine, engine.prefill, engine.decode)
    engine = Engine(prefill_model, kv_dtype=args.kv_cache_dtype, mesh=mesh, host_kv_bytes=args.host_kv_memory, **common,
                    decode_context_parallel=args.decode_context_parallel,
                    decode_model=None if decode_model is prefill_model else decode_model)
    return Setup(model, prefill_model, decode_model, engine, engine, engine)


def weight_sets(args, path: str, backend: str, mesh, progress: bool) -> tuple[Model, Model, Model]:
    """The model at path as the flags load it, and its prefill and decode weight sets (one
    object when the flags give both one format)."""
    # Placed on the (prefill) mesh as it is read; copies converted from it (--*-weights) are placed by the engine.
    model = mixserve.load(path, progress=progress, backend=backend, mesh=mesh,
                          expert_parallel=args.expert_parallel, nvfp4_activations=args.nvfp4_activations,
                          mtp=args.speculative_tokens > 0 and args.draft == "mtp")  # unused weights stay on disk
    if model.tokenizer is None:  # no tokenizer files (the tiny presets): text as UTF-8 bytes
        model = dataclasses.replace(model, tokenizer=ByteTokenizer())
    prefill_model = with_weights(model, args.prefill_weights)
    decode_model = prefill_model if args.decode_weights == args.prefill_weights else with_weights(model, args.decode_weights)
    return model, prefill_model, decode_model


def serve(args, backend: str, mesh, setup: Setup, texts: list[str]) -> dict:
    """Serve the prompts' texts and report (printed, or as JSON)."""
    model, prefill_model, decode_model = setup.model, setup.prefill_model, setup.decode_model
    engine, prefiller, decoder = setup.engine, setup.prefiller, setup.decoder
    tp, budget, random_weights = args.tensor_parallel, args.kv_memory, args.model in TINY_PRESETS
    two_sets = args.disaggregate or decode_model is not prefill_model
    # (plan, bytes in all, bytes on the fullest device): equal without tensor parallelism
    weight_sets = {"prefill": (str(prefill_model.plan), param_bytes(prefill_model),
                               sharding.bytes_per_device(prefiller.runner.model.params))}
    if two_sets:
        weight_sets["decode"] = (str(decode_model.plan), param_bytes(decode_model),
                                 sharding.bytes_per_device(decoder.runner.decode_model.params))
    prompts = [model.tokenizer.encode(t) for t in texts]
    kept = frozenset()  # the special tokens of the markup a --chat reply is read for stay in its text
    if args.chat:
        fmt = ReplyFormat.detect(list(model.chat_template.templates.values()))
        kept = ReplyParser.for_request(fmt, texts[0], None).markup_ids(model.tokenizer)  # the prompts end alike
    text_tok = text_tokenizer(model.tokenizer, args.skip_special_tokens, kept)
    t0 = time.perf_counter()
    results = engine.generate(prompts, **request_options(args), kept_special_ids=kept)
    wall = time.perf_counter() - t0
    pc, c = prefiller.counters, decoder.counters
    formats = ("bfloat16", "fp8_e4m3") + ((TILED,) if model.config.attention_kind == "mla" else ())
    capacity = {name: budget // (sharding.kv_bytes_per_device(model.config, kv_format(name, model.dtype), mesh,
                                                              args.decode_context_parallel, decoder.mtp_drafts)
                            * args.page_size) * args.page_size
                for name in formats}
    report = {
        "model": args.model,
        "random_weights": random_weights,
        "kv_cache_dtype": args.kv_cache_dtype,
        # What the FP8 pools are scaled by: the checkpoint's calibrated per-layer scales (Engine's
        # default when it ships them), or 1.
        "kv_scales": "checkpoint" if decoder.kv_scales_from_checkpoint else "1",
        "integrity": args.integrity,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                     "repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
                     "presence_penalty": args.presence_penalty, "seed": results[0].seed,
                     "structured_output": args.structured_output and dataclasses.asdict(args.structured_output)},
        "backend": backend,
        "weight_sets": weight_sets,
        "tensor_parallel": args.tensor_parallel,
        "expert_parallel": args.expert_parallel,
        "decode_context_parallel": args.decode_context_parallel,
        "logprobs_mode": args.logprobs_mode,
        "speculative": {"tokens": args.speculative_tokens, "draft": args.draft} if args.speculative_tokens else None,
        "kv_bytes_per_token": decoder.bytes_per_token,  # the decode pool's (the one that holds the running requests)
        "kv_bytes_per_token_per_device": decoder.kv_bytes_per_token_per_device,
        "pool_tokens": decoder.capacity_tokens,
        "max_seq_len": decoder.max_seq_len,
        "pool_tokens_at_same_memory": capacity,
        "prefill_tok_per_s": pc.prefill_tokens / pc.prefill_s if pc.prefill_s else None,
        "decode_tok_per_s": c.decode_tokens / c.decode_s if c.decode_s else None,
        "wall_s": wall,
        "latency_s": latency_percentiles(results),
        "counters": vars(c),
        "grammar_mask_s": decoder.grammars.mask_s + (prefiller.grammars.mask_s if args.disaggregate else 0.0),
        "requests": [
            {"prompt_tokens": len(p), "cached_tokens": r.cached_tokens, "status": r.status, "reason": r.reason, "tokens": r.tokens,
             "text": output_text(text_tok, r), "stop_reason": r.stop_reason, "ttft_s": r.ttft_s,
             "latency_s": r.latency_s, "queue_s": r.queue_s, "logprobs": r.logprobs and [lp._asdict() for lp in r.logprobs],
             "prompt_logprobs": r.prompt_logprobs and [lp and lp._asdict() for lp in r.prompt_logprobs],
             "routed_experts": None if r.routed_experts is None else r.routed_experts.tolist(),
             "indexer_topk": None if r.indexer_topk is None else r.indexer_topk.tolist()}
            for p, r in zip(prompts, results)
        ],
    }
    if args.chat:  # each reply read as /v1/chat/completions reads it
        for text, r in zip(texts, report["requests"]):
            if fmt.reasoning:
                reply = ReplyParser.for_request(fmt, text, None).parse(r["text"], final=True)
                r["reasoning_content"], r["content"] = reply.reasoning or None, reply.content
            else:
                r["reasoning_content"], r["content"] = None, r["text"]
    if args.disaggregate:
        report["disaggregated"] = {
            "prefill_devices": sorted(str(d) for d in jax.tree.leaves(prefiller.runner.pools)[0].devices()),
            "decode_devices": sorted(str(d) for d in jax.tree.leaves(decoder.runner.pools)[0].devices()),
            "prefill_kv_cache_dtype": args.prefill_kv_cache_dtype,
            "prefill_counters": vars(pc),
            "handover": vars(engine.counters),
        }
    if args.json:
        json.dump(finite_or_null(report), sys.stdout, indent=2, default=str, allow_nan=False)
        print()
        return report
    if random_weights:
        print(f"model: {args.model} (tiny preset, RANDOM weights: the generated bytes are noise)")
    else:
        print(f"model: {args.model}")
    scales = " with the checkpoint's FP8 scales" if decoder.kv_scales_from_checkpoint else ""
    print(f"KV cache: {args.kv_cache_dtype}{scales}, page size {args.page_size}, integrity={args.integrity}, "
          f"kernels: {backend}")
    for phase, (plan, nbytes, device_bytes) in weight_sets.items():
        label = f"{phase} weights" if len(weight_sets) == 2 else "weights"
        experts = ", experts split by expert" if args.expert_parallel else ""
        split = f", {device_bytes / 2**20:.2f} MiB on each of {tp} devices{experts}" if tp > 1 else ""
        print(f"{label}: {plan} ({nbytes / 2**20:.2f} MiB{split})")
    if args.disaggregate:
        d, h = report["disaggregated"], engine.counters
        print(f"disaggregated: prefill on {', '.join(d['prefill_devices'])} ({args.prefill_kv_cache_dtype} KV), decode on "
              f"{', '.join(d['decode_devices'])} ({args.kv_cache_dtype} KV); {h.handovers} requests handed over: "
              f"{h.pages_sent} pages, {h.bytes_sent} bytes, {h.pages_shared} shared by the decode pool, {h.handover_s:.2f} s")
    elif len(weight_sets) == 2:
        print("two weight sets on one device: prefill and decode formats differ (--disaggregate splits them)")
    s = report["sampling"]
    if args.temperature > 0:
        print(f"sampling: temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}, min_p {s['min_p']}, seed {s['seed']} "
              f"(--seed {s['seed']} repeats this run)")
    if (s["repetition_penalty"], s["frequency_penalty"], s["presence_penalty"]) != (1, 0, 0):
        print(f"penalties: repetition {s['repetition_penalty']}, frequency {s['frequency_penalty']}, "
              f"presence {s['presence_penalty']}")
    for i, r in enumerate(report["requests"]):
        # random weights say nothing as text, but a structured output's text shows the structure
        text_shown = not random_weights or args.structured_output is not None
        shown = repr(r["content"] if args.chat else r["text"]) if text_shown else r["tokens"]
        why = r["reason"] or (r["stop_reason"] is not None and f"stopped by {r['stop_reason']!r}")
        print(f"[{i}] {r['status']}: {r['prompt_tokens']} prompt tokens -> {shown}" + (f" ({why})" if why else ""))
        if args.chat and r["reasoning_content"] and not random_weights:
            print(f"    reasoning: {r['reasoning_content']!r}")
        if r["prompt_logprobs"] and len(r["prompt_logprobs"]) > 1:
            print(f"    prompt: {perplexity(r['prompt_logprobs'][1:], 'raw_logprobs')} over its last "
                  f"{len(r['prompt_logprobs']) - 1} tokens")
        if r["logprobs"]:
            print(f"    generated: {perplexity(r['logprobs'], args.logprobs_mode)}, ranks {[lp['rank'] for lp in r['logprobs']]}")
    lat = report["latency_s"]
    if lat["ttft"]:
        ms = {name: " / ".join(f"{q * 1e3:.1f}" for q in qs.values()) if qs else "-" for name, qs in lat.items()}
        print(f"latency (ms, median / p99; includes compilation): time to first token {ms['ttft']}, "
              f"between steps {ms['inter_token']}, queued {ms['queue']}")
    print(f"prefill: {pc.prefill_tokens} tokens in {pc.prefill_s:.2f} s ({report['prefill_tok_per_s'] or 0:.1f} tok/s, includes compilation)")
    print(f"decode:  {c.decode_tokens} tokens in {c.decode_s:.2f} s ({report['decode_tok_per_s'] or 0:.1f} tok/s, {c.steps} steps, includes compilation)")
    if args.speculative_tokens:
        rate = c.accepted_tokens / c.drafted_tokens if c.drafted_tokens else 0.0
        print(f"speculative: {c.accepted_tokens} of {c.drafted_tokens} {args.draft} draft tokens accepted ({rate:.0%}), "
              f"{c.decode_tokens / max(c.verified_rows, 1):.2f} tokens per request and decode step")
    bf16, fp8 = capacity["bfloat16"], capacity["fp8_e4m3"]
    per_device = f" ({decoder.kv_bytes_per_token_per_device} per device)" if tp > 1 else ""
    print(f"KV bytes per token: {decoder.bytes_per_token}{per_device}; pool: {decoder.capacity_tokens} tokens in "
          f"{budget} bytes{' per device' if tp > 1 else ''}")
    tiled = f"; {TILED}: {capacity[TILED]} tokens{times(capacity[TILED], bf16)}" if TILED in capacity else ""
    print(f"same memory, BF16 KV: {bf16} tokens; FP8 KV: {fp8} tokens{times(fp8, bf16)}{tiled}")
    if not args.no_prefix_caching:
        evicted = pc.evicted_pages + (c.evicted_pages if args.disaggregate else 0)  # both pools of a pair
        host = prefiller.host_cache
        from_host = f" ({pc.host_restored_tokens} of them from the host tier, {len(host)} pages there)" if host is not None else ""
        print(f"prefix cache: {pc.prefix_cache_hits + pc.host_restored_tokens} of {pc.prefix_cache_queries} prompt "
              f"tokens were cached{from_host}, {evicted} pages evicted")
    print(f"counters: preemptions={c.preemptions} aborts={c.aborts} rejections={engine.counters.rejections} peak pages={c.peak_pages_in_use}")
    return report


def output_text(tokenizer, result, include_stop_str: bool = False) -> str:
    """The generated text without the stop token or stop string that ended it, as vLLM gives it (the
    tokens keep the stop token, and the token that completed a stop string with what it holds past
    it); include_stop_str: with either (vLLM's include_stop_str_in_output), nothing after it."""
    why = result.stop_reason
    text = tokenizer.decode(result.tokens[:-1] if isinstance(why, int) and not include_stop_str else result.tokens)
    if not isinstance(why, str):
        return text
    # the occurrence its last token completed: an earlier one was passed over (min_tokens)
    before = len(tokenizer.decode(result.tokens[:-1]).rstrip("\ufffd"))
    at = text.find(why, max(0, before - len(why) + 1))
    at = at if at >= 0 else text.find(why)  # a decoder whose later tokens rewrite earlier text (IncrementalDecoder)
    return text if at < 0 else text[:at + (len(why) if include_stop_str else 0)]


def latency_percentiles(results) -> dict[str, dict[str, float]]:
    """Median and p99 of the requests' time to first token, gaps between the steps that gave them
    tokens (Result.step_gaps_s), and queue time ({}: none)."""
    samples = {"ttft": [r.ttft_s for r in results if r.ttft_s is not None],
               "inter_token": [g for r in results for g in r.step_gaps_s()],
               "queue": [r.queue_s for r in results if r.queue_s is not None]}
    return {name: {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))} if xs else {}
            for name, xs in samples.items()}


def perplexity(logprobs: list[dict], mode: str) -> str:
    mean = sum(lp["logprob"] for lp in logprobs) / len(logprobs)
    if mode.endswith("logits"):  # the values are logits: no perplexity
        return f"mean logit {mean:.3f} ({mode})"
    return f"mean logprob {mean:.3f} (perplexity {math.exp(-mean) if -mean < 700 else math.inf:.2f}, {mode})"


def finite_or_null(x):
    """The report with NaN and infinities as null: strict JSON has no token for them (a model
    whose logits overflow reports NaN logprobs)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def times(tokens: int, bf16_tokens: int) -> str:
    """' (2.00x)': tokens against BF16 KV's at the same memory (none where BF16 holds no page)."""
    return f" ({tokens / bf16_tokens:.2f}x)" if bf16_tokens else " (BF16 KV holds no page at this memory)"


if __name__ == "__main__":
    main()

"""The ``multilora`` command line.

    multilora demo                                   # default model, demo adapters, one mixed batch
    multilora make-demo-adapters DIR                 # write PEFT demo adapters for a model
    multilora generate --adapter bot=./bot --prompt bot "Hi" --prompt - "Hello"
    multilora generate --adapter bot=./bot --jsonl requests.jsonl --json
    multilora memory                                 # the memory plan for this machine
    multilora serve --adapter bot=./bot --port 8000  # an OpenAI-compatible HTTP server (runtime/server.py)
    multilora serve-ray --replicas 2 --adapter bot=./bot   # the same routes on Ray Serve replicas (ray_serve.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from multilora.runtime.config import CLI_USE_CPU as USE_CPU  # the CLI's words for the API's device='cpu'
from multilora.runtime.config import as_flag_error as _as_flag_error, check_adapter_name, check_api_key, flag_words

BASE_NAMES = ("-", "none", "base")


def _parse_adapter(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


def _int_range(low: int, high: int | None = None):
    """An argparse type: an int in ``[low, high]`` (the message says which range and what was got)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low or (high is not None and v > high):
            want = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
        return v
    return parse


_JSONL_KEYS = ("prompt", "adapter")


class _ShapeOnly:
    """A stand-in tokenizer for ``PromptTokenizer.encode``, so that its checks of a prompt (a string of valid
    Unicode, chat messages with string 'role' in ``CHAT_ROLES`` and string 'content', or token ids) run before the
    model and its tokenizer load (``_check_prompt``): any text is one token."""

    def __call__(self, text: str, **kwargs: Any) -> dict:
        return {"input_ids": [0]}

    def apply_chat_template(self, messages: list, **kwargs: Any) -> str:
        return ""


def _check_prompt(prompt: Any) -> None:
    """ValueError (``prompt: ...``, the engine's words) for a prompt the engine would refuse whatever the model: not
    a string, chat messages or token ids; a chat message without string 'role' and 'content' or with an unknown role;
    text that is not valid Unicode; a negative token id or none at all. (What needs the model is checked as the
    engine takes the prompt: ids past its vocabulary, a chat template that refuses the messages.)"""
    from multilora.runtime.tokenizer import PromptTokenizer

    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        negative = [t for t in prompt if t < 0]  # (the vocabulary's end is checked at the load)
        if negative:
            raise ValueError(f"prompt: token ids must be >= 0 (and below the model's vocabulary size), got "
                             f"{negative[:5]}")
    PromptTokenizer(_ShapeOnly(), vocab_size=sys.maxsize, eos_token_ids=(), source="--jsonl").encode(prompt)


def _read_jsonl(path: str) -> list[tuple[Any, str | None, str]]:
    """``(prompt, adapter, "FILE:LINE")`` of each non-blank line, every line checked (``_check_prompt``) before the
    model loads; ValueError naming ``FILE:LINE``."""
    items = []
    try:
        if path == "-" and sys.stdin is None:
            raise OSError("standard input is closed")
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--jsonl: cannot read {path!r}: {e}") from e
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark (Notepad, PowerShell) is no part of line 1
    # lines end at "\n" only (JSON Lines): str.splitlines would also split at U+2028, U+0085 and others that JSON
    # strings may hold unescaped
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: not UTF-8 text (JSON Lines is UTF-8): byte {raw[e.start]:#04x} at "
                             f"column {e.start + 1}") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: malformed JSON ({e})") from e
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise ValueError(f"{path}:{n}: expected an object with a 'prompt' (and optional 'adapter'), got {line[:80]!r}")
        unknown = sorted(set(obj) - set(_JSONL_KEYS))
        if unknown:  # a misspelt "adapter" would otherwise run the prompt on the base model
            raise ValueError(f"{path}:{n}: unknown key(s) {unknown}; a line has 'prompt' and optionally 'adapter'")
        adapter = obj.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise ValueError(f"{path}:{n}: 'adapter' must be a string or null, got {adapter!r}")
        try:
            _check_prompt(obj["prompt"])
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        items.append((obj["prompt"], adapter, f"{path}:{n}"))
    return items


_SERVED = ("model_type llama: Llama 2/3, SmolLM2; mistral; qwen2: Qwen2/2.5; qwen3: Qwen3 dense; "
           "phi3: Phi-3 mini/medium; gemma2: Gemma 2 (multilora.config.SERVED_MODEL_TYPES)")
_MODEL_HELP = f"HF model directory or .gguf file of a served family ({_SERVED}; default: embedded SmolLM2-135M-Instruct)"


def _help_with_default(action: argparse.Action) -> str | None:
    """An engine flag's help ending with its default, ``(default: 16)`` (``on`` / ``off`` for a --X / --no-X pair),
    unless the help names it already; a None default is said by the field's help; a lone ``--no-X`` switch
    (``--no-cuda-graphs``) says nothing more."""
    text, default = action.help or "", action.default
    if isinstance(default, bool) and not isinstance(action, argparse.BooleanOptionalAction):
        return action.help
    if default is None or text.startswith("ignored"):  # the field's help says what None means (tests/test_cli.py
        return action.help  # checks that each one does); an ignored flag (--page-rows) has no default to speak of
    shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
    if re.search(rf"\(default:? {re.escape(shown)}\b", text):
        return text
    return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class _DefaultsInHelp:
    """What ``EngineConfig.add_cli_flags`` adds its flags to: an argument group whose flags' help names the default
    (``_help_with_default``; set on the action, over any text argparse added itself)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = self.group.add_argument(*args, **kwargs)
        action.help = _help_with_default(action)
        return action


_ALLOW_PICKLE = ("also load an adapter directory whose only weight file is adapter_model.bin (a pickle, as peft "
                 "writes with safe_serialization=False). SECURITY: unpickling can run code from the file "
                 "(torch.load(weights_only=True) limits what it may do, but pickle loaders have had exploits): "
                 "only for files you trust; better, convert them to adapter_model.safetensors (default: off, such "
                 "a directory is refused)")


def _engine_args(sp: argparse.ArgumentParser) -> None:
    """--model, --adapter NAME=PATH and one flag per EngineConfig field."""
    from multilora.runtime.config import EngineConfig

    sp.add_argument("--model", help=_MODEL_HELP)
    sp.add_argument("--adapter", action="append", default=[], type=_parse_adapter, metavar="NAME=PATH",
                    help="load a PEFT adapter directory under NAME (repeatable)")
    EngineConfig.add_cli_flags(_DefaultsInHelp(sp.add_argument_group("engine options (EngineConfig)")))


def _http_args(sp: argparse.ArgumentParser) -> None:
    """The flags of the HTTP server that serve and serve-ray share."""
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                                                        "IPv4 interface)")
    sp.add_argument("--port", type=_int_range(1, 65535), default=8000, help="TCP port (default 8000)")
    sp.add_argument("--served-model-name", help="the base model's name in requests (default: --model as given, or "
                                                "the embedded model's file name without .gguf)")
    sp.add_argument("--api-key", default=os.environ.get("MULTILORA_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: $MULTILORA_API_KEY)")


_VERBOSE = ("log what the engine does (-v: each step of the start, -vv: also the memory plan; serve and serve-ray "
            "log the start without it, and the plan with -v); before or after the command")


def _verbose_flag(sp: argparse.ArgumentParser) -> None:
    """``-v`` after the command too (``multilora generate -vv``), counted with those before it (``multilora -v
    generate -v`` is ``-vv``): its own destination, added up by ``verbosity``."""
    sp.add_argument("-v", "--verbose", action="count", dest="verbose_after", default=0, help=_VERBOSE)


def verbosity(args: argparse.Namespace) -> int:
    """How many ``-v`` were given, before and after the command."""
    return getattr(args, "verbose", 0) + getattr(args, "verbose_after", 0)


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or "(not installed)" when run from a bare tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("multilora")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="multilora", description="Batched multi-LoRA inference.", allow_abbrev=False)
    p.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE)
    p.add_argument("--version", action="version", version=f"multilora {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the main job on the default model with demo adapters")
    d.add_argument("--adapters-dir", help="where the demo adapters are kept: DIR/demo-a, demo-b, demo-c (default: "
                                          "$MULTILORA_HOME/demo-adapters/<model file name without .gguf, or model directory "
                                          "name>, "
                                          "MULTILORA_HOME defaulting to ~/.cache/multilora)")
    d.add_argument("--max-tokens", type=_int_range(1), default=32, help="tokens per completion (default 32)")
    d.add_argument("--model", help="another model instead of the default (" + _SERVED + ")")
    d.add_argument("--max-lora-rank", type=_int_range(1), default=None,
                   help="largest adapter rank the demo's engine accepts (default the engine's, 64): for adapters "
                        "written by make-demo-adapters --rank above that")

    m = sub.add_parser("make-demo-adapters", help="write seeded random PEFT adapters for a model")
    m.add_argument("out_dir")
    m.add_argument("--model", help=_MODEL_HELP)
    m.add_argument("--rank", type=_int_range(1), default=8, help="LoRA rank of every demo adapter, at most the "
                   "narrowest target module's width (default 8)")
    m.add_argument("--force", action="store_true", help="overwrite demo adapters already in OUT_DIR (default: refuse)")

    g = sub.add_parser("generate", help="generate for prompts, each with its own adapter, in one batch")
    _engine_args(g)
    g.add_argument("--prompt", action="append", nargs=2, default=[], metavar=("ADAPTER", "TEXT"),
                   help=f"a prompt and its adapter name ({', '.join(repr(b) for b in BASE_NAMES)}: the base model, "
                        "so no --adapter may take those names); repeatable")
    g.add_argument("--jsonl", help='file of {"prompt": ..., "adapter": NAME|null} lines, UTF-8, "-" for stdin '
                                   '(prompt: text, chat messages or a list of token ids; no other keys)')
    g.add_argument("--chat", action="store_true", help="wrap text prompts as a user message and apply the chat template")
    g.add_argument("--max-tokens", type=_int_range(1), default=64,
                   help="most tokens generated per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (default 0: off; -1 is off too, as in the HTTP API)")
    g.add_argument("--seed", type=int, help="random seed of sampled requests (default: none, not reproducible)")
    g.add_argument("--stop", action="append", default=[],
                   help="stop string, matched literally (repeatable); in a shell, a newline is $'\\n', not \"\\n\"")
    g.add_argument("--allow-pickle", action="store_true", help=_ALLOW_PICKLE)
    g.add_argument("--json", action="store_true", help="print one JSON object per request")
    g.add_argument("--stats", action="store_true", help="print engine statistics at the end")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (adapter = the request's model)")
    _engine_args(s)
    _http_args(s)
    s.add_argument("--adapter-root", help="with --allow-runtime-adapters: runtime-loaded adapter paths must resolve "
                                          "inside this directory (default: none, any directory this process can read)")
    s.add_argument("--allow-runtime-adapters", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    s.add_argument("--allow-pickle", action="store_true", help=_ALLOW_PICKLE + "; for the --adapter directories only, "
                   "not for adapters loaded at run time")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="step the engine in a child process (HTTP, tokenization and detokenization stay in this one, "
                        "so they never hold the GIL the steps need); default: on (--no-engine-process: one process)")
    s.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, before listening, run the step shapes serving reaches (on the first --adapter, if "
                        "any) so that kernels are compiled and decode graphs captured before the first request; "
                        "default: on")

    r = sub.add_parser("serve-ray", help="the server's routes on N engine replicas under Ray Serve, each request "
                                         "routed to a replica that holds its adapter (runtime/ray_serve.py)")
    _engine_args(r)
    for action in r._actions:  # taken, so that giving it is a clear error (_cmd_serve_ray), but not offered in --help
        if action.dest == "tensor_parallel_size":
            action.help = argparse.SUPPRESS
    _http_args(r)
    r.add_argument("--replicas", type=_int_range(1), default=1, help="engine replicas (default 1)")
    r.add_argument("--adapters-per-replica", type=_int_range(1), default=16,
                   help="adapters registered on one replica at once; past it the least recently used is unloaded "
                        "(default 16)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (default 1)")
    r.add_argument("--replica-gpus", type=float,
                   help="Ray GPUs per replica (default: 1 if this machine has CUDA, else 0)")
    r.add_argument("--max-ongoing-requests", type=_int_range(1), default=64,
                   help="HTTP requests one replica takes at once (default 64)")
    r.add_argument("--address", help="a running Ray cluster (e.g. 'auto'; default: start one on this machine)")
    for flag in ("--adapter-root", "--allow-runtime-adapters"):  # serve's; refused with the reason
        r.add_argument(flag, nargs="?", const=True, help=argparse.SUPPRESS)

    try:
        from multilora.runtime.cli_memory import add_memory_parser
    except ImportError:
        pass
    else:
        add_memory_parser(sub)
    for sp in sub.choices.values():  # every command takes -v after its name too
        _verbose_flag(sp)
        # a flag is spelt out: argparse would take --max-token as --max-tokens without a word, and a flag added later
        # would turn a script's shortening ambiguous (an error) or point it at the new flag
        sp.allow_abbrev = False
    return p


def _cmd_generate(args: argparse.Namespace) -> int:
    from multilora.runtime.sampling import SamplingParams

    reserved = sorted({n for n, _ in args.adapter} & set(BASE_NAMES))
    if reserved:  # --prompt base ... would mean the base model, not this adapter
        raise ValueError(f"--adapter {reserved[0]}=...: {', '.join(repr(b) for b in BASE_NAMES)} name the base model "
                         "in --prompt; give the adapter another NAME")
    items: list[tuple[Any, str | None, str]] = []  # (prompt, adapter, where it was given: named in errors)
    for a, text in args.prompt:
        where = f"--prompt {a} {text[:40]!r}"
        try:
            _check_prompt(text)  # text that is not valid Unicode (undecodable bytes in the argument)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        items.append((text, None if a in BASE_NAMES else a, where))
    if args.jsonl:
        items += _read_jsonl(args.jsonl)
    if not items:
        raise ValueError(f"--jsonl {args.jsonl}: no requests in the file (a line per request: {{\"prompt\": ..., "
                         f"\"adapter\": ...}})" if args.jsonl else "no prompts (use --prompt ADAPTER TEXT or --jsonl FILE)")
    if args.chat:
        items = [([{"role": "user", "content": p}] if isinstance(p, str) else p, a, w) for p, a, w in items]
    known = {n for n, _ in args.adapter}
    unknown = [(a, w) for _, a, w in items if a is not None and a not in known]
    if unknown:
        a, where = unknown[0]
        base = (f" (the base model is {', '.join(repr(b) for b in BASE_NAMES)} in --prompt, null in --jsonl)"
                if a in BASE_NAMES else "")
        more = f"; {len(unknown) - 1} more prompt(s) name unknown adapters" if len(unknown) > 1 else ""
        raise ValueError(f"{where}: adapter {a!r} was not given with --adapter NAME=PATH{base}{more}")
    if args.top_k < -1:
        raise ValueError(f"--top-k: expected a positive int, or 0 or -1 (off), got {args.top_k}")
    for stop in args.stop:  # taken as given (a model may print a backslash and an n), but most who type it mean a newline
        if "\\n" in stop and "\n" not in stop:
            print(f"note: --stop '{stop}' holds a backslash and an n, matched literally, not a newline; in bash a "
                  f"newline is $'\\n'", file=sys.stderr)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=max(args.top_k, 0), seed=args.seed, stop=args.stop)
    except ValueError as e:  # name the flag, not the dataclass field
        raise ValueError(re.sub(r"SamplingParams\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from e
    unused = [f for f, on in (("--top-p", args.top_p != 1.0), ("--top-k", args.top_k > 0),
                              ("--seed", args.seed is not None)) if on]
    if args.temperature == 0 and unused:  # greedy: the most likely token, whatever they say
        print(f"note: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with --temperature 0 "
              f"(greedy, the default): pass a temperature > 0 to sample", file=sys.stderr)
    engine = _load_engine(args)
    try:
        outs = engine.generate([p for p, _, _ in items], adapters=[a for _, a, _ in items], sampling=sampling,
                               progress=not args.json)
    except ValueError as e:  # what needs the model (ids past its vocabulary, ...): name the line, not prompts[i]
        m = re.match(r"prompts\[(\d+)\]: ", str(e))
        if m is None or int(m.group(1)) >= len(items):
            raise
        why = flag_words(str(e)[m.end():], ("kv_cache_bytes", "adapter_pool_bytes", "unified_pool", "max_tokens"))
        raise ValueError(f"{items[int(m.group(1))][2]}: {why}") from e
    for o in outs:
        if args.json:
            print(json.dumps({"prompt": o.prompt, "adapter": o.adapter, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "error": o.error}))
        else:
            if isinstance(o.prompt, str):
                prompt = o.prompt
            elif o.prompt and isinstance(o.prompt[-1], dict):  # chat messages: show the last one
                prompt = o.prompt[-1].get("content", o.prompt)
            else:  # token ids
                prompt = f"<{len(o.prompt)} token ids>"
            n = len(o.token_ids)  # the text as made (repr: leading newlines shown, as --json has them)
            print(f"[{o.adapter or 'base'}] {prompt}\n    -> {o.text!r}  ({n} token{'s' * (n != 1)}, {o.finish_reason})")
            if o.error:
                print(f"    error: {o.error}")
    run = engine.last_run
    n = run["generated_tokens"]
    print(f"{n} token{'s' * (n != 1)} in {run['seconds']:.2f} s = {run['tokens_per_second']:.1f} tokens/s",
          file=sys.stderr if args.json else sys.stdout)
    ended = sum(isinstance(o.prompt, str) and not o.token_ids and o.finish_reason == "stop" for o in outs)
    if ended and not args.chat and getattr(getattr(engine, "tokenizer", None), "chat_template", None):
        print(f"note: {ended} text prompt(s) got no tokens (the model ended at once); a chat or instruct model usually "
              f"needs its chat template: add --chat", file=sys.stderr)
    if args.stats:
        print(json.dumps(engine.stats(), indent=2), file=sys.stderr if args.json else sys.stdout)
    failed = sum(o.finish_reason == "error" for o in outs)
    if failed:  # a script can tell: the other requests' outputs are printed all the same
        print(f"multilora generate: {failed} of {len(outs)} request(s) failed (finish_reason 'error')", file=sys.stderr)
    return 1 if failed else 0


def _check_adapter_names(args: argparse.Namespace) -> None:
    """ValueError naming ``--adapter`` for a NAME given more than once or one ``load_adapter`` would refuse
    (``check_adapter_name``), before the model loads."""
    from multilora.runtime.config import check_adapter_name

    for name, path in args.adapter:
        check_adapter_name(name, f"--adapter {name}={path}: the name")
    names = [n for n, _ in args.adapter]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--adapter: name(s) {twice} given more than once (each NAME=PATH needs its own NAME)")


def _engine_config(args: argparse.Namespace) -> Any:
    """The ``EngineConfig`` of the engine flags, every --adapter path checked first (a typo fails in a second, not
    after the model loads); errors name the flag."""
    from multilora.runtime.config import EngineConfig, resolve_device
    from multilora.runtime.weights import ModelLoadError

    for name, path in args.adapter:
        if not Path(path).exists():
            raise ValueError(f"--adapter {name}={path}: no such file or directory")
    _check_adapter_names(args)
    try:
        config = EngineConfig.from_cli(args)
        resolve_device(config.device, use_cpu=USE_CPU)  # a CPU build asked for cuda fails here, not at the load
        if config.max_seq_len is not None:  # past the model's context: from its config, before the weights load
            from multilora.runtime.sizing import default_max_seq_len
            from multilora.runtime.weights import model_config

            default_max_seq_len(model_config(getattr(args, "model", None)), config, "cpu")
    except ModelLoadError:
        raise
    except ValueError as e:
        raise _as_flag_error(e) from e
    _check_adapter_files(args.adapter, config.max_lora_rank, args.allow_pickle)
    return config


def _check_adapter_files(adapters: list[tuple[str, str]], max_rank: int, allow_pickle: bool) -> None:
    """What needs no model, for every ``--adapter NAME=PATH``: a directory, its config, a weight file (a pickle only
    with ``allow_pickle``), the rank within ``max_rank``; ValueError naming the flag."""
    from multilora.runtime.adapters import AdapterError, check_adapter_files

    for name, path in adapters:
        try:
            check_adapter_files(path, max_rank=max_rank, allow_pickle=allow_pickle)
        except AdapterError as e:
            raise ValueError(f"--adapter {name}={path}: {e}") from e


def _refuse_served_name(served: str, adapter_names: Any) -> None:
    """ValueError naming ``--adapter`` when an adapter has the base model's served name ``served`` (requests naming
    it would reach the base model)."""
    if served in set(adapter_names):
        raise ValueError(f"--adapter {served}=...: that name is the base model's served name (requests naming it "
                         f"would reach the base model): give the adapter another name, or the base model another "
                         f"one with --served-model-name")


def _load_engine(args: argparse.Namespace, *, progress: bool = False) -> Any:
    """The engine of --model and the engine flags, with every --adapter loaded (``_engine_config``'s checks first),
    warmed up where the command has ``--warmup`` on."""
    from multilora.runtime.engine_process import load_engine

    return load_engine(args.model, _engine_config(args), args.adapter, progress=progress,
                       warmup=getattr(args, "warmup", False), allow_pickle=args.allow_pickle)


def _check_port(host: str, port: int) -> None:
    """Raise ValueError naming ``--host`` / ``--port`` when ``host:port`` cannot be listened on now (in use, or not
    an address of this machine), so a serve fails in a second instead of after loading the model. Binds every
    address the host resolves to, as asyncio's ``create_server`` (what uvicorn runs) does: ``""`` is every
    interface, a name with IPv6 and IPv4 addresses needs both. (Another process can still take the port in
    between: uvicorn then reports it.)"""
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address this machine can listen on ({e.strerror or e})") from e
    socks = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks (no IPv6): asyncio skips it too
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds: TIME_WAIT is no conflict
            if family == getattr(socket, "AF_INET6", None) and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio: :: and 0.0.0.0 side by side
            try:
                sock.bind(addr)
            except OSError as e:
                raise ValueError(f"--host {host} --port {port}: cannot listen on {addr[0]} ({e.strerror or e}); is "
                                 f"another server running? choose another --port") from e
    finally:
        for sock in socks:
            sock.close()


def _check_api_key(args: argparse.Namespace) -> None:
    """An empty --api-key (or MULTILORA_API_KEY=) is refused before loading (``config.check_api_key``)."""
    check_api_key(args.api_key, "--api-key (default: $MULTILORA_API_KEY)")


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    """A SIGTERM handler: stop as Ctrl-C does (``_cmd_serve``)."""
    raise KeyboardInterrupt


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from multilora.runtime.server import create_app
    except ImportError as e:
        raise ValueError(f"serve: {e.name} is not installed (pip install 'multilora[serve]')") from e
    _check_api_key(args)
    if args.adapter_root is not None and not Path(args.adapter_root).is_dir():
        raise ValueError(f"--adapter-root {args.adapter_root}: not a directory")
    log = logging.getLogger("multilora")
    if args.allow_runtime_adapters and args.adapter_root is None:
        log.warning("--allow-runtime-adapters without --adapter-root: %s may load any adapter directory this process "
                    "can read; bound the paths with --adapter-root DIR",
                    "a client with the API key" if args.api_key else "any client (no --api-key)")
    elif args.adapter_root is not None and not args.allow_runtime_adapters:
        log.warning("--adapter-root %s has no effect without --allow-runtime-adapters (it bounds the paths "
                    "/v1/load_lora_adapter may load)", args.adapter_root)
    from multilora.runtime.weights import resolve_model_path

    # the base model's name in requests: as given, else the default model file's stem (a missing model fails here in a
    # second, before any loading)
    served = args.served_model_name if args.served_model_name is not None else (
        args.model or resolve_model_path(None).stem)
    # a request's "model" carries it, as it carries an adapter's name: the same rule
    check_adapter_name(served, "--served-model-name" if args.served_model_name is not None else
                       "the served model name (by default --model as given: pass --served-model-name NAME)")
    _refuse_served_name(served, [n for n, _ in args.adapter])
    _check_port(args.host, args.port)  # before minutes of loading, not after
    if args.engine_process:  # the engine and its steps in a child process; HTTP, tokens and text in this one
        import functools

        from multilora.runtime.engine_process import EngineProcess, load_engine

        config = _engine_config(args)  # the flags and --adapter paths first, as in one process
        resolve_model_path(args.model)  # a missing model fails here in a second, before the engine process starts
        engine = EngineProcess.start(functools.partial(load_engine, args.model, config, args.adapter, progress=True,
                                                       warmup=args.warmup, allow_pickle=args.allow_pickle))
    else:
        engine = _load_engine(args, progress=True)
    try:
        app = create_app(engine, served_model_name=served, api_key=args.api_key, adapter_root=args.adapter_root,
                         allow_runtime_adapters=args.allow_runtime_adapters)
    except BaseException:
        engine.close()
        raise
    # uvicorn shuts down gracefully on SIGINT and SIGTERM (open streams finish), then raises the signal again under
    # the handler it found: SIGTERM's default would end this process there, with no engine.close() and exit -15
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_config=None)  # our logging (timestamps, levels) for all
    except KeyboardInterrupt:  # uvicorn shut down gracefully on Ctrl-C or SIGTERM, then raised it again
        pass
    finally:
        if args.engine_process:  # uvicorn's shutdown closed it; not if it never started (a port in use)
            engine.close()
    return 0


def _cmd_serve_ray(args: argparse.Namespace) -> int:
    from multilora.runtime.config import EngineConfig
    from multilora.runtime.ray_serve import RayAppSpec, build_app

    _check_api_key(args)
    for flag in ("adapter_root", "allow_runtime_adapters"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}: not supported by serve-ray: an adapter loaded at run time "
                             f"would reach one replica only; give the catalog with --adapter NAME=PATH")
    if args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: not supported by serve-ray (Ray places "
                         f"each replica on its own GPUs; a replica's worker processes would not be); run "
                         f"`multilora serve --tensor-parallel-size N` per host instead")
    if args.replica_gpus is None:
        import torch

        args.replica_gpus = 1.0 if torch.cuda.is_available() else 0.0
    _check_adapter_names(args)
    overrides: dict = {}
    if args.address is None and args.replicas > 1:
        # its own local cluster: every replica is on this host. Each engine's memory plan would otherwise budget the
        # whole host (and the whole GPU for a fraction of one), and N of them would over-commit it N times
        if args.local_ranks == 1:
            overrides["local_ranks"] = args.replicas
        if 0 < args.replica_gpus < 1:
            overrides["gpu_memory_fraction"] = args.gpu_memory_fraction * args.replica_gpus
        if overrides:
            logging.getLogger("multilora").info("serve-ray: %d replicas on this host: each engine plans with %s",
                                                args.replicas, ", ".join(f"{k}={v:g}" for k, v in overrides.items()))
    try:
        config = EngineConfig.from_cli(args, progress=False, **overrides)
    except ValueError as e:
        raise _as_flag_error(e) from e
    try:
        spec = RayAppSpec(model=args.model, config=config, adapters=dict(args.adapter),
                          served_model_name=args.served_model_name, api_key=args.api_key, replicas=args.replicas,
                          adapters_per_replica=args.adapters_per_replica, replica_cpus=args.replica_cpus,
                          replica_gpus=args.replica_gpus, max_ongoing_requests=args.max_ongoing_requests)
    except ValueError as e:  # name the flag, not the field
        def flag(m: re.Match) -> str:
            return "--" + ("adapter" if m.group(1) == "adapters" else m.group(1).replace("_", "-"))

        raise ValueError(re.sub(r"RayAppSpec\.(\w+)", flag, str(e))) from e
    # what the replicas would find only after Ray started: a missing model, an adapter named as the default model's
    # stem, adapter files they would refuse (the replicas load no pickle); on a cluster of our own (every replica on
    # this host) also a device this host lacks and a host:port it cannot listen on (Ray's HTTP proxy binds it here)
    from multilora.runtime.adapters.disk import PICKLE_NAME, weights_path
    from multilora.runtime.config import resolve_device
    from multilora.runtime.weights import resolve_model_path

    stem = resolve_model_path(args.model).stem  # (a missing model fails here)
    _refuse_served_name(spec.base_name or stem, spec.adapters)
    _check_adapter_files(args.adapter, config.max_lora_rank, allow_pickle=True)
    for name, path in args.adapter:
        wpath = weights_path(Path(path))
        if wpath is not None and wpath.name == PICKLE_NAME:
            raise ValueError(f"--adapter {name}={path}: {wpath}: only a pickle weight file was found; serve-ray's "
                             f"replicas load no pickle (it can run arbitrary code when loaded): convert it to "
                             f"adapter_model.safetensors (e.g. safetensors.torch.save_file(torch.load(path, "
                             f"weights_only=True), ...)), or serve it with `multilora serve --allow-pickle`")
    if args.address is None:
        try:
            resolve_device(config.device, use_cpu=USE_CPU)
        except ValueError as e:
            raise _as_flag_error(e) from e
        _check_port(args.host, args.port)
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ValueError(f"serve-ray: {e.name} is not installed (pip install 'multilora[ray]')") from e
    ray.init(address=args.address or "local")  # local: a new cluster of our own, even if `ray start` made one
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a service manager's stop: as Ctrl-C
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(spec), name="multilora", route_prefix="/")
        logging.getLogger("multilora").info("serving on http://%s:%d with %d replicas; Ctrl-C stops", args.host,
                                            args.port, args.replicas)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if args.address is None:  # our own cluster
            serve.shutdown()
        else:  # someone's cluster: take away only this app
            serve.delete("multilora")
        ray.shutdown()
    return 0


def _cmd_make(args: argparse.Namespace) -> int:
    import torch

    from multilora.runtime.demo import DEMO_ADAPTERS, check_demo_rank, check_output_dir, write_demo_adapters
    from multilora.runtime.weights import load_model_files, model_config, resolve_model_path

    check_output_dir(args.out_dir, "OUT_DIR")
    if not args.force:  # before the model loads: an adapter someone trained or edited there is never lost
        for name in DEMO_ADAPTERS:
            held = [f for f in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
                    if (Path(args.out_dir) / name / f).exists()]
            if held:
                raise ValueError(f"{Path(args.out_dir) / name} already holds an adapter ({', '.join(held)}): pass "
                                 f"--force to overwrite the demo adapters there, or choose another OUT_DIR")
    path = resolve_model_path(args.model)
    try:  # from the configuration alone (a GGUF's metadata, a config.json): before the weights load
        check_demo_rank(args.rank, model_config(path))
    except ValueError as e:
        if str(e).startswith("rank:"):  # the library names its argument; here it is the flag
            raise ValueError(f"--{e}") from None
        raise
    config, weights = load_model_files(path, dtype=torch.float32)
    written = write_demo_adapters(args.out_dir, "OUT_DIR", weights, config, rank=args.rank,
                                  base_model_name_or_path=str(path))
    for name, d in written.items():
        print(f"{name}: {d}")
    from multilora.runtime.config import EngineConfig

    default = EngineConfig().max_lora_rank
    if args.rank > default:
        print(f"note: rank {args.rank} is above the engine's default max_lora_rank {default}: load these adapters with "
              f"--max-lora-rank {args.rank} (demo, generate, serve) or Engine(max_lora_rank={args.rank})",
              file=sys.stderr)
    return 0


def _engine_option_error(msg: str, args: argparse.Namespace) -> bool:
    """Whether ``msg`` is ``Engine: <field>...`` for an ``EngineConfig`` field that this command takes as a flag
    (generate, serve, serve-ray: one flag per field), so ``as_flag_error`` names the flag."""
    import dataclasses

    from multilora.runtime.config import EngineConfig

    m = re.match(r"Engine: (\w+)[ =]", msg)
    return (m is not None and getattr(args, "command", None) in ("generate", "serve", "serve-ray")
            and m.group(1) in {f.name for f in dataclasses.fields(EngineConfig)}
            and hasattr(args, m.group(1)))


def log_level(command: str, verbose: int) -> int:
    """The logging level of a command run with ``verbose`` times ``-v``: serve and serve-ray log INFO (their start,
    their requests' failures) and DEBUG with ``-v``; the other commands WARNING, INFO with ``-v``, DEBUG with ``-vv``
    (the engine's memory plan is a DEBUG record)."""
    if command in ("serve", "serve-ray"):
        return logging.DEBUG if verbose else logging.INFO
    return (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with unknown arguments reported by the command's own parser (its usage and
    ``multilora generate: error: ...``) rather than the top level's."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        command = sub.choices[args.command]
        given = list(sys.argv[1:] if argv is None else argv)
        before = given[:given.index(args.command)] if args.command in given else []
        misplaced = [x for x in extra if x in before and x.split("=")[0] in command._option_string_actions]  # noqa: SLF001
        if misplaced:  # a flag of the command given before it: the top level does not take it
            parser.error(f"{misplaced[0]} is an option of '{args.command}': put it after the command "
                         f"(multilora {args.command} {misplaced[0]} ...)")
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports POLLERR on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or stdout is no file (a test's capture)
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(build_parser(), argv)
    serving = args.command in ("serve", "serve-ray")  # a long-running process: what it does, when
    logging.basicConfig(level=log_level(args.command, verbosity(args)),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if serving else
                        "%(levelname)s %(name)s: %(message)s")
    from multilora.runtime.adapter_cache import UnknownAdapterError
    from multilora.runtime.engine_process import EngineProcessError
    from multilora.runtime.weights import ModelLoadError

    try:
        if args.command == "demo":
            from multilora.runtime.demo import run_demo

            return run_demo(args.adapters_dir, max_tokens=args.max_tokens, model=args.model,
                            max_lora_rank=args.max_lora_rank)
        if args.command == "make-demo-adapters":
            return _cmd_make(args)
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "serve-ray":
            return _cmd_serve_ray(args)
        if args.command == "memory":
            from multilora.runtime.cli_memory import run_memory

            code = run_memory(args)
            sys.stdout.flush()  # here, where a closed pipe is handled, not at the interpreter's exit
            return code
    except (ValueError, ModelLoadError, UnknownAdapterError, EngineProcessError) as e:  # AdapterError: a ValueError
        msg = str(e)
        if isinstance(e, ModelLoadError) and msg.startswith("model: ") and getattr(args, "model", None) is not None:
            msg = f"--model {args.model}: {msg[len('model: '):]}"  # the flag, not the Engine argument
        elif _engine_option_error(msg, args):  # an engine option refused once the model is known: its flag
            msg = str(_as_flag_error(ValueError(msg)))
        print(f"multilora {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading or generating (a server that started handles its own)
        print(f"multilora {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():  # another pipe (a child process's): a real error
            raise
        # `multilora memory | head`: the reader left; no traceback (Python's signal docs' way: stdout to /dev/null,
        # so the flush at exit fails no more)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # as a process killed by SIGPIPE, what a shell pipeline expects
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

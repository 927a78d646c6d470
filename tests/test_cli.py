"""The ``multilora`` command line, run in-process (``cli.main``) on a tiny random Llama with the SmolLM2
tokenizer: demo adapters that peft accepts, ``generate`` with command-line and JSONL prompts, JSON and text
output, stats, and the errors a user gets for bad input (exit code 2, a message naming the problem).

Generated tokens are checked against the Python API on the same model (greedy), and the demo adapters
against peft's own forward.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.cli import main  # noqa: E402
from testsupport import tokenizer_dir as _tokenizer_dir  # noqa: E402

VOCAB = 49152
DEMO_NAMES = ("demo-a", "demo-b", "demo-c")


def _hf_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        initializer_range=0.2,
    )


def _hf_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_hf_config()).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-tiny")
    _hf_model().save_pretrained(str(d))
    for f in _tokenizer_dir(tmp_path_factory).iterdir():
        shutil.copy(f, d)
    return d


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``multilora ARGV`` (argparse errors exit via SystemExit)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def demo_dir(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-demo")
    code = main(["make-demo-adapters", str(d / "adapters"), "--model", str(tiny)])
    assert code == 0
    return d / "adapters"


@pytest.fixture(scope="module")
def engine(tiny, demo_dir):
    e = Engine(model=str(tiny), progress=False)
    for n in DEMO_NAMES:
        e.load_adapter(n, demo_dir / n)
    return e


def _json_lines(out):
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _greedy(engine, prompts, adapters, n):
    outs = engine.generate(prompts, adapters=adapters, sampling=SamplingParams(max_tokens=n, temperature=0.0))
    return [o.token_ids for o in outs]


# -------------------------------------------------------------------------------- make-demo-adapters
def test_make_demo_adapters_prints_and_writes_peft_dirs(tiny, tmp_path, capsys):
    code, out, _ = run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny, "--rank", 4)
    assert code == 0
    for n in DEMO_NAMES:
        assert f"{n}: {tmp_path / 'ad' / n}" in out
        cfg = json.loads((tmp_path / "ad" / n / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"
        assert (tmp_path / "ad" / n / "adapter_model.safetensors").is_file()


def test_make_demo_adapters_refuses_a_rank_above_the_narrowest_module(tiny, tmp_path, capsys):
    """--rank 100000 was taken (each adapter ~122 GB: killed for memory with no message); a rank above the narrowest
    target module's width is refused naming that module and its widths, before anything is written, and the widest
    rank allowed is written."""
    from multilora.config import ModelConfig
    from multilora.runtime.demo import DEMO_ADAPTERS

    cfg = ModelConfig.from_hf_dict(json.loads((tiny / "config.json").read_text()))
    shapes = {m: cfg.module_shape(m) for _, _, mods in DEMO_ADAPTERS.values() for m in mods}
    most = min(min(s) for s in shapes.values())
    code, out, err = run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny, "--rank", most + 1)
    assert code == 2 and out == "" and not (tmp_path / "ad").exists()
    assert re.search(rf"--rank: expected an int from 1 to {most} \(module '\w+' is \d+ -> \d+: a LoRA rank above "
                     rf"its narrower side adds only bytes\), got {most + 1}", err), err
    assert run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny, "--rank", most)[0] == 0


def test_make_demo_adapters_names_an_argument_of_the_wrong_type(tiny, tmp_path):
    """The Python call with its arguments swapped or mistyped raised a raw AttributeError / TypeError; each is a
    ValueError naming the argument, before anything is written."""
    from multilora.config import ModelConfig
    from multilora.runtime.demo import make_demo_adapters

    cfg = ModelConfig.from_hf_dict(json.loads((tiny / "config.json").read_text()))
    out = tmp_path / "ad"
    for args, kwargs, match in (((out, cfg, {}), {}, r"^base_weights: expected a dict"),
                                ((out, {}, {}), {}, r"^config: expected a ModelConfig .*got dict$"),
                                ((5, {}, cfg), {}, r"^out_dir: expected a directory path .*got int 5$"),
                                ((out, {}, cfg), {"names": "math"}, r"^names: expected a list of "),
                                ((out, {}, cfg), {"names": ["maths"]}, r"^names: expected a list of .*got \['maths'\]")):
        with pytest.raises(ValueError, match=match):
            make_demo_adapters(*args, **kwargs)
    assert not out.exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_make_demo_adapters_files_get_the_umask_mode(tiny, tmp_path, capsys, umask):
    """Files as open() would make them under the umask of the moment they are written (0666 less it), not
    tempfile's private 0600: with 022 a service run as another user can read them, with 077 it cannot."""
    old = os.umask(umask)
    try:
        assert run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny, "--rank", 2)[0] == 0
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "ad" / DEMO_NAMES[0]).iterdir()}
    want = 0o666 & ~umask
    assert modes == {"adapter_config.json": want, "adapter_model.safetensors": want}, modes


@pytest.mark.parametrize("where", ["mkdir", "safetensors"])
def test_make_demo_adapters_a_failed_write_names_out_dir(tiny, tmp_path, capsys, monkeypatch, where):
    """A write that fails after the model loaded (a directory the permission check passed but mkdir refuses; a full
    disk, which safetensors reports as its own error type) is exit 2 naming OUT_DIR and the reason, not a
    traceback; no temporary file is left."""
    import safetensors.torch
    from pathlib import Path

    (tmp_path / "ad").mkdir()
    if where == "mkdir":
        def fail(self, *a, **k):
            raise OSError(28, "No space left on device", str(self))

        monkeypatch.setattr(Path, "mkdir", fail)
        want = "the demo adapters could not be written: No space left on device"
    else:
        def fail(*a, **k):
            raise safetensors.SafetensorError("Error while serializing: IoError(File too large (os error 27))")

        monkeypatch.setattr(safetensors.torch, "save_file", fail)
        want = "the demo adapters could not be written: " + str(tmp_path / "ad" / DEMO_NAMES[0])
    code, out, err = run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny)
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"OUT_DIR {tmp_path / 'ad'}: {want}" in err, err
    assert not [p for p in (tmp_path / "ad").rglob("*") if p.is_file()]


def test_make_demo_adapters_checks_rank_and_directory_before_the_weights_load(tiny, tmp_path, capsys, monkeypatch):
    """``--rank`` past the narrowest targeted module, and a directory the file system will not make (``/proc``, a
    read-only mount: os.access passes there for root; simulated here), fail naming the flag before any weight is
    read; the probe leaves no directory behind, and never removes one it did not make (``new/../x`` names an
    existing empty ``x``)."""
    import errno
    import tempfile

    import multilora.runtime.weights as weights
    from multilora.runtime.demo import check_output_dir

    def no_load(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(weights, "load_model_files", no_load)
    code, out, err = run(capsys, "make-demo-adapters", tmp_path / "a" / "b", "--model", tiny, "--rank", 999)
    assert code == 2 and "--rank: expected an int from 1 to " in err and "got 999" in err, err
    assert not (tmp_path / "a").exists()
    (tmp_path / "x").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    check_output_dir(tmp_path / "new" / ".." / "x", "OUT_DIR")
    check_output_dir(tmp_path / "y" / "z", "OUT_DIR")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # x kept; nothing made is left

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ValueError, match=rf"^--adapters-dir {tmp_path}/ro: cannot make the directory: Read-only"):
        check_output_dir(tmp_path / "ro", "--adapters-dir")
    check_output_dir(tmp_path / "x", "--adapters-dir")  # an existing directory needs no probe


def test_flags_are_not_taken_by_a_prefix(capsys):
    """argparse would take ``--max-token 5`` as ``--max-tokens 5`` silently (and a flag added later could make a
    script's prefix ambiguous): a prefix is an unrecognized argument, in every command; short flags still group."""
    for argv in (["generate", "--max-token", "5"], ["memory", "--snap", "x.json"], ["serve", "--allow-runtime"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"unrecognized arguments: {argv[1]}" in err, (argv, err)
    assert run(capsys, "memory", "-vv", "--json")[0] == 0


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """``multilora memory --json | head -1``: the reader closing the pipe ends the command as SIGPIPE would (status
    141), with nothing on stderr, not a BrokenPipeError traceback. The read end is closed before the child writes."""
    import subprocess
    import sys

    snap = tmp_path / "snap.json"
    assert main(["memory", "--save-snapshot", str(snap)]) == 0
    p = subprocess.Popen([sys.executable, "-m", "multilora.runtime.cli", "memory", "--snapshot", str(snap), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_memory_json_carries_the_notes_the_text_prints(tmp_path, capsys):
    """The "note:" lines under the text plan (here a 0 B pool an engine would refuse) are ``notes`` in ``--json``."""
    snap = tmp_path / "snap.json"
    assert run(capsys, "memory", "--save-snapshot", snap)[0] == 0
    code, out, _ = run(capsys, "memory", "--snapshot", snap, "--adapter-pool-bytes", "0")
    text_notes = [line[len("note: "):] for line in out.splitlines() if line.startswith("note: ")]
    code, out, _ = run(capsys, "memory", "--snapshot", snap, "--adapter-pool-bytes", "0", "--json")
    assert code == 0 and text_notes and json.loads(out)["notes"] == text_notes


def test_memory_save_snapshot_says_where_it_saved(tmp_path, capsys):
    snap = tmp_path / "snap.json"
    code, out, err = run(capsys, "memory", "--save-snapshot", snap, "--json")
    assert code == 0 and json.loads(out)["plan"] and json.loads(snap.read_text())  # stdout stays one JSON object
    assert f"snapshot saved to {snap} (plan from it again with --snapshot {snap})" in err, err


def test_make_demo_adapters_refuses_to_overwrite_without_force(tiny, tmp_path, capsys):
    """An adapter already in OUT_DIR (here a hand-edited one) is kept unless --force: the error names the directory,
    the file and the flag, and nothing is written; with --force the demo adapter replaces it."""
    d = tmp_path / "ad" / DEMO_NAMES[0]
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text('{"mine": true}')
    code, out, err = run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny)
    assert code == 2 and out == ""
    assert f"{d} already holds an adapter (adapter_config.json): pass --force" in err
    assert (d / "adapter_config.json").read_text() == '{"mine": true}' and sorted(p.name for p in d.parent.iterdir()) == [d.name]
    code, out, _ = run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny, "--force")
    assert code == 0 and json.loads((d / "adapter_config.json").read_text())["peft_type"] == "LORA"


@pytest.mark.parametrize("name", DEMO_NAMES)
def test_demo_adapters_load_in_peft_and_match_the_engine(demo_dir, engine, name):
    from peft import PeftModel

    model = PeftModel.from_pretrained(_hf_model(), str(demo_dir / name)).eval()
    rows = [[5, 17, 300, 4000], [9, 8, 7]]
    ours = engine.logits(rows, adapters=[name, None])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([rows[0]])).logits[0, -1]
        with model.disable_adapter():
            base = model(input_ids=torch.tensor([rows[1]])).logits[0, -1]
    assert float((ours[0] - ref).norm() / ref.norm()) < 1e-4
    assert float((ours[1] - base).norm() / base.norm()) < 1e-4


# ------------------------------------------------------------------------------------------ generate
def test_generate_json_one_object_per_prompt(tiny, demo_dir, engine, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--adapter", f"a={demo_dir / 'demo-a'}",
                         "--prompt", "a", "hi", "--prompt", "-", "hello", "--max-tokens", 4, "--json")
    assert code == 0, err
    objs = _json_lines(out)
    assert len(objs) == 2 and len(out.strip().splitlines()) == 2  # nothing else on stdout
    assert [o["prompt"] for o in objs] == ["hi", "hello"]
    assert [o["adapter"] for o in objs] == ["a", None]
    for o in objs:
        assert set(o) >= {"prompt", "adapter", "text", "token_ids", "finish_reason", "error"}
        assert o["error"] is None and o["finish_reason"] in ("length", "stop")
    assert [o["token_ids"] for o in objs] == _greedy(engine, ["hi", "hello"], ["demo-a", None], 4)
    assert "tokens/s" in err


def test_generate_text_output_with_stats(tiny, demo_dir, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--adapter", f"b={demo_dir / 'demo-b'}",
                         "--prompt", "b", "Tell me", "--prompt", "none", "Hi", "--max-tokens", 3, "--stats")
    assert code == 0, err
    assert "[b] Tell me" in out and "[base] Hi" in out and "tokens/s" in out
    stats = json.loads(re.search(r"^\{.*^\}", out, re.S | re.M).group(0))
    assert stats["requests_finished"] == 2 and stats["adapters_loaded"] == 1
    assert 0 < stats["generated_tokens"] <= 6
    # the adapter's image, read at load, is counted apart from the tier moves
    assert stats["adapter_preloads"] == 1 and stats["bytes_preloaded"] == stats["host_tier_bytes"] > 0
    assert stats["bytes_disk_to_host"] == 0


def test_generate_stats_go_to_stderr_with_json(tiny, demo_dir, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "Hi", "--max-tokens", 2,
                         "--json", "--stats")
    assert code == 0, err
    assert len(_json_lines(out)) == 1
    stats = json.loads(re.search(r"^\{.*^\}", err, re.S | re.M).group(0))
    assert stats["requests_finished"] == 1 and "pool_pages_used" in stats


def test_generate_jsonl_input(tiny, demo_dir, engine, tmp_path, capsys):
    msgs = [{"role": "user", "content": "Name a colour."}]
    lines = [json.dumps({"prompt": "Once upon a time", "adapter": "c"}), "",
             json.dumps({"prompt": msgs, "adapter": None}), json.dumps({"prompt": "No adapter key"})]
    f = tmp_path / "req.jsonl"
    f.write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, "generate", "--model", tiny, "--adapter", f"c={demo_dir / 'demo-c'}",
                         "--jsonl", f, "--prompt", "c", "first", "--max-tokens", 3, "--json")
    assert code == 0, err
    objs = _json_lines(out)
    # command-line prompts come first, then the file's lines in order (blank lines skipped)
    assert [o["prompt"] for o in objs] == ["first", "Once upon a time", msgs, "No adapter key"]
    assert [o["adapter"] for o in objs] == ["c", "c", None, None]
    assert [o["token_ids"] for o in objs] == _greedy(
        engine, ["first", "Once upon a time", msgs, "No adapter key"], ["demo-c", "demo-c", None, None], 3)


def test_generate_jsonl_token_id_prompt_text_output(tiny, engine, tmp_path, capsys):
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"prompt": [5, 6, 7], "adapter": None}) + "\n")
    want = engine.generate([[5, 6, 7]], sampling=SamplingParams(max_tokens=2))[0]
    code, out, err = run(capsys, "generate", "--model", tiny, "--jsonl", f, "--max-tokens", 2)
    assert code == 0, err
    # the text as made (leading whitespace shown, as --json has it), its token count and finish reason
    assert f"[base] <3 token ids>\n    -> {want.text!r}  (2 tokens, {want.finish_reason})\n" in out, out
    assert re.search(r"^2 tokens in [\d.]+ s = ", out, re.M), out
    f.write_text(json.dumps({"prompt": [5, 6, 7], "adapter": None}) + "\n")
    code, out, err = run(capsys, "generate", "--model", tiny, "--jsonl", f, "--max-tokens", 1)
    assert code == 0 and "(1 token, length)" in out and re.search(r"^1 token in ", out, re.M), out


def test_generate_chat_flag_applies_the_template(tiny, engine, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--chat", "--prompt", "-", "Hi", "--max-tokens", 3,
                         "--json")
    assert code == 0, err
    (obj,) = _json_lines(out)
    msgs = [{"role": "user", "content": "Hi"}]
    assert obj["prompt"] == msgs
    assert obj["token_ids"] == _greedy(engine, [msgs], [None], 3)[0]


# ------------------------------------------------------------------------------------------- errors
def test_bad_adapter_spec_exits_2(tiny, capsys):
    code, _, err = run(capsys, "generate", "--model", tiny, "--adapter", "no-equals-sign", "--prompt", "-", "hi")
    assert code == 2
    assert "--adapter" in err and "NAME=PATH" in err and "no-equals-sign" in err
    assert "argument --adapter: expected NAME=PATH, got 'no-equals-sign'" in err, err  # the option named once


def test_unknown_adapter_name_exits_2(tiny, demo_dir, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--adapter", f"a={demo_dir / 'demo-a'}",
                         "--prompt", "zz", "hi", "--prompt", "a", "ok")
    assert code == 2 and "zz" in err and "--adapter" in err
    assert out == ""


def test_missing_adapter_dir_exits_2(tiny, tmp_path, capsys):
    missing = tmp_path / "nope"
    code, _, err = run(capsys, "generate", "--model", tiny, "--adapter", f"x={missing}", "--prompt", "x", "hi")
    assert code == 2 and f"--adapter x={missing}: no such file or directory" in err, err


def test_bad_adapter_dir_names_the_flag_and_name(tiny, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "generate", "--model", tiny, "--adapter", f"x={empty}", "--prompt", "x", "hi")
    assert code == 2 and f"--adapter x={empty}:" in err and "adapter_config.json" in err, err


def _adapter_dirs(base, demo_dir):
    """Broken adapter directories, each with the words its error must say."""
    bad_json = base / "bad-json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{oops")
    no_weights = base / "no-weights"
    no_weights.mkdir()
    shutil.copy(demo_dir / "demo-a" / "adapter_config.json", no_weights)
    big = base / "rank-128"
    shutil.copytree(demo_dir / "demo-a", big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 128, "rank_pattern": {}}))
    empty = base / "empty"
    empty.mkdir()
    a_file = base / "a-file"
    a_file.write_text("x")
    return {a_file: "expected a directory", empty: "adapter_config.json", bad_json: "malformed JSON",
            no_weights: "no adapter weights", big: "rank 128 exceeds the engine's max_lora_rank 64 (raise it to 128 "
                                                   "or more: Engine(max_lora_rank=128), --max-lora-rank 128)"}


def test_adapter_directories_are_checked_before_the_model_loads(demo_dir, tmp_path, capsys):
    """Each broken --adapter is refused, naming the flag, the name and the defect, before the model: here the model
    path does not exist, and its error would come first otherwise."""
    for path, words in _adapter_dirs(tmp_path, demo_dir).items():
        code, _, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--adapter", f"x={path}",
                           "--prompt", "x", "hi")
        assert code == 2 and f"--adapter x={path}:" in err and words in err and "no-model" not in err, err


@pytest.mark.parametrize("argv, words", [
    (["--adapter", "base=DEMO", "--prompt", "base", "hi"], "--adapter base=...: '-', 'none', 'base' name the base "
                                                          "model in --prompt; give the adapter another NAME"),
    (["--adapter", "a=DEMO", "--adapter", "a=DEMO", "--prompt", "a", "hi"], "--adapter: name(s) ['a'] given more "
                                                                            "than once"),
    (["--device", "cuda:x", "--prompt", "-", "hi"], "--device: 'cuda:x' is not a device"),
    (["--device", "tpu", "--prompt", "-", "hi"], "--device: 'tpu' is not a device"),
])
def test_generate_refuses_before_the_model_loads(demo_dir, tmp_path, capsys, argv, words):
    argv = [str(demo_dir / "demo-a") if a == "DEMO" else a.replace("=DEMO", f"={demo_dir / 'demo-a'}") for a in argv]
    code, out, err = run(capsys, "generate", "--model", tmp_path / "no-model", *argv)
    assert code == 2 and out == "" and words in err and "no-model" not in err, err


def test_the_engine_checks_its_device_before_the_model(tmp_path):
    with pytest.raises(ValueError, match=r"Engine: device='meta': multilora runs on 'cpu' and 'cuda' devices"):
        Engine(model=str(tmp_path / "no-model"), device="meta")  # (the missing model would say "does not exist")


def test_engine_config_checks_the_devices_form_when_made():
    """EngineConfig refuses a device no machine runs where it is made (as the README says of every field); whether
    this machine has CUDA is the Engine's check, so cuda:3 is a fine config here."""
    from multilora.runtime.config import EngineConfig

    with pytest.raises(ValueError, match=r"Engine: device='tpu' is not a device \(.*\); expected 'cpu', 'cuda'"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match=r"Engine: device='meta': multilora runs on 'cpu' and 'cuda' devices"):
        EngineConfig(device="meta")
    assert [EngineConfig(device=d).device for d in ("cpu", "cuda:3", None)] == ["cpu", "cuda:3", None]


def test_cuda_on_a_machine_without_it_names_the_flag(tmp_path, capsys, monkeypatch):
    """The command line's error names its flag, `--device cpu`, where the Python API's says `device='cpu'`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, wherever this runs
    code, _, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--device", "cuda", "--prompt", "-", "hi")
    assert code == 2 and "--device: 'cuda', but CUDA is not available here" in err, err
    assert err.rstrip().endswith("; use --device cpu") and "device='cpu'" not in err, err


@pytest.mark.parametrize("device, words", [
    ("cuda", "--device: 'cuda', but CUDA is not available here"),
    ("tpu:0", "--device: 'tpu:0' is not a device"),
])
def test_memory_refuses_a_device_this_machine_lacks(capsys, monkeypatch, device, words):
    """`multilora memory --device cuda` on a machine without CUDA (and a device name torch does not know) exits 2
    with the flag's error, not torch's traceback ("Torch not compiled with CUDA enabled")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, "memory", "--device", device)
    assert code == 2 and words in err and "Traceback" not in err, err
    if device == "cuda":
        assert err.rstrip().endswith("; use --device cpu"), err


def test_cuda_on_a_machine_without_it_names_the_engine_argument(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^Engine: device='cuda', but CUDA is not available here .*; use "
                                         r"device='cpu'$"):
        Engine(model=str(tmp_path / "no-model"), device="cuda")  # (the missing model would say "does not exist")


@pytest.mark.parametrize("argv, words", [
    (["serve", "--port", "99999"], "argument --port: expected an integer in 1..65535, got 99999"),
    (["serve", "--port", "0"], "argument --port: expected an integer in 1..65535, got 0"),
    (["make-demo-adapters", "out", "--rank", "0"], "argument --rank: expected an integer >= 1, got 0"),
    (["demo", "--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, got 0"),
    (["demo", "--max-tokens", "ten"], "argument --max-tokens: expected an integer, got 'ten'"),
])
def test_flag_ranges_are_checked_by_the_parser(capsys, argv, words):
    code, _, err = run(capsys, *argv)
    assert code == 2 and words in err, err


def test_a_commands_flag_before_the_command_is_named_as_misplaced(capsys):
    code, out, err = run(capsys, "--json", "generate", "--prompt", "-", "hi")
    assert code == 2 and out == ""
    assert "multilora: error: --json is an option of 'generate': put it after the command" in err, err


def test_version(capsys):
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"multilora {version('multilora')}\n"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "-", "hi", "--bogus", "x"], ["memory", "--bogus", "x"],
                                  ["demo", "--bogus", "x"]])
def test_an_unknown_flag_is_named_by_its_commands_parser(capsys, argv):
    """An unknown flag after a command is reported with that command's usage and name (it was the top level's:
    ``multilora: error``, whose usage lists only the commands)."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"usage: multilora {argv[0]} "), err
    assert err.rstrip().endswith(f"multilora {argv[0]}: error: unrecognized arguments: --bogus x"), err


@pytest.mark.parametrize("value", ["0", "-3", "ten", "1.5"])
def test_max_tokens_is_refused_in_the_same_words_by_every_command(capsys, value):
    """demo and generate (every command with --max-tokens) check it with the same parser type: the same message,
    but for the program's name."""
    errors = {}
    for command in ("demo", "generate"):
        code, out, err = run(capsys, command, "--max-tokens", value)
        assert code == 2 and out == "", err
        errors[command] = err.strip().splitlines()[-1].replace(f"multilora {command}: ", "multilora COMMAND: ")
    assert errors["demo"] == errors["generate"], errors
    got = value if value.lstrip("-").isdigit() else repr(value)
    want = "an integer >= 1" if value.lstrip("-").isdigit() else "an integer"
    assert errors["demo"] == f"multilora COMMAND: error: argument --max-tokens: expected {want}, got {got}", errors


@pytest.mark.parametrize("line,match", [
    ('{"prompt": "hi", "adaptr": "a"}', r"unknown key\(s\) \['adaptr'\]; a line has 'prompt' and optionally "
                                        r"'adapter'"),
    ("{not json", r"malformed JSON"),
    ('["a list"]', r"expected an object with a 'prompt'"),
    ('{"adapter": "a"}', r"expected an object with a 'prompt'"),
    ('{"prompt": "hi", "adapter": 3}', r"'adapter' must be a string or null"),
    ('{"prompt": "hi", "adapter": "zzz"}', r": adapter 'zzz' was not given with --adapter NAME=PATH"),
    ('{"prompt": "hi", "adapter": "none"}', r"adapter 'none' was not given with --adapter NAME=PATH \(the base model "
                                            r"is '-', 'none', 'base' in --prompt, null in --jsonl\)"),
])
def test_bad_jsonl_line_exits_2_naming_the_line(tiny, tmp_path, capsys, line, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    code, out, err = run(capsys, "generate", "--model", tiny, "--jsonl", f)
    assert code == 2 and out == ""
    assert f"{f}:2" in err and re.search(match, err), err


def test_jsonl_lines_end_at_newline_only_and_must_be_utf8(tiny, tmp_path, capsys, monkeypatch):
    """A JSON string may hold U+2028 / U+0085 unescaped (json.dumps(ensure_ascii=False) writes them): such a line is
    one prompt, as json.loads reads it; a line that is not UTF-8 is named with its byte; "-" reads stdin."""
    import io

    from multilora.runtime.cli import _read_jsonl

    lines = [json.dumps({"prompt": "one\u2028two\x85three"}, ensure_ascii=False), json.dumps({"prompt": "b"})]
    f = tmp_path / "sep.jsonl"
    f.write_bytes(("\r\n".join(lines) + "\n").encode())
    assert [p for p, _, _ in _read_jsonl(str(f))] == [json.loads(line)["prompt"] for line in lines]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(f.read_bytes())))
    assert [(p, where) for p, _, where in _read_jsonl("-")] == [("one\u2028two\x85three", "-:1"), ("b", "-:2")]
    f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())  # a UTF-8 byte order mark first: not part of line 1
    assert [p for p, _, _ in _read_jsonl(str(f))] == [json.loads(line)["prompt"] for line in lines]
    monkeypatch.setattr("sys.stdin", None)  # (a closed stdin: `<&-`)
    with pytest.raises(ValueError, match=r"^--jsonl: cannot read '-': standard input is closed$"):
        _read_jsonl("-")
    f.write_bytes(b'{"prompt": "fine"}\n{"prompt": "\xff"}\n')
    code, out, err = run(capsys, "generate", "--model", tiny, "--jsonl", f)
    assert code == 2 and out == "" and f"{f}:2: not UTF-8 text (JSON Lines is UTF-8): byte 0xff at column 13" in err, err


def test_sampling_flags_that_greedy_ignores_get_a_note(tiny, capsys):
    """--top-p / --top-k / --seed under the default --temperature 0 change nothing (greedy): a note says so; with a
    temperature they are used and no note comes."""
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--max-tokens", 1, "--top-k", 5,
                       "--seed", 3)
    assert code == 0 and "note: --top-k, --seed have no effect with --temperature 0 (greedy, the default)" in err, err
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--max-tokens", 1, "--top-p", 0.5,
                       "--temperature", 0.7, "--seed", 3)
    assert code == 0 and "no effect" not in err, err
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--top-p", 0)  # refused: no note
    assert code == 2 and "--top-p: expected" in err and "note:" not in err, err


@pytest.mark.parametrize("opt,value,field", [("--max-tokens", 0, "max_tokens"), ("--temperature", -1, "temperature"),
                                             ("--top-p", 0, "top_p"), ("--top-k", -2, "top_k")])
def test_bad_sampling_option_exits_2(tiny, capsys, opt, value, field):
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", opt, value)
    assert code == 2 and f"{opt}: expected" in err and f"got {value}" in err, err


def test_top_k_minus_one_is_off_as_in_the_http_api(tiny, capsys):
    """--top-k -1 means off (vLLM's convention, which the HTTP API's top_k takes too): the same greedy tokens as 0."""
    outs = []
    for k in (0, -1):
        code, out, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--max-tokens", 4,
                             "--top-k", k, "--temperature", 0)
        assert code == 0, err
        outs.append([line for line in out.splitlines() if "tokens/s" not in line])  # timings differ
    assert outs[0] == outs[1] and outs[0]


def test_jsonl_file_missing_exits_2(tiny, tmp_path, capsys):
    code, _, err = run(capsys, "generate", "--model", tiny, "--jsonl", tmp_path / "none.jsonl")
    assert code == 2 and "none.jsonl" in err


def test_a_request_the_kv_cache_cannot_hold_names_the_flags(tiny, capsys):
    """The engine's refusal of a request longer than the whole KV cache, in generate's words: the prompt's flag, and
    --max-tokens / --kv-cache-bytes for what to change (the values quoted as given: max_tokens=...)."""
    code, out, err = run(capsys, "generate", "--model", tiny, "--kv-cache-bytes", "8KiB", "--kv-block-size", "4",
                         "--max-tokens", "100", "--prompt", "-", "hello there")
    assert code == 2 and out == "", err
    assert "--prompt - 'hello there': request: " in err and "max_tokens=100" in err, err
    assert err.rstrip().endswith("lower --max-tokens, shorten the prompt or raise --kv-cache-bytes"), err


def test_a_stop_of_backslash_n_is_noted(tiny, capsys, monkeypatch):
    """``--stop "\\n"`` (a shell's backslash and n) is matched as given, with a note on stderr saying so; a real
    newline is not noted."""
    import multilora.runtime.cli as cli

    monkeypatch.setattr(cli, "_load_engine", lambda args, **k: (_ for _ in ()).throw(ValueError("not loaded")))
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--stop", "\\n")
    assert code == 2 and "note: --stop '\\n' holds a backslash and an n, matched literally" in err, err
    code, _, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--stop", "\n")
    assert code == 2 and "note:" not in err, err


def test_no_prompts_exits_2(tiny, capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", tiny)
    assert code == 2 and "no prompts" in err
    (tmp_path / "empty.jsonl").write_text("\n  \n")  # blank lines only: the file is named, not "no prompts"
    code, _, err = run(capsys, "generate", "--model", tiny, "--jsonl", tmp_path / "empty.jsonl")
    assert code == 2 and f"--jsonl {tmp_path / 'empty.jsonl'}: no requests in the file" in err, err


def test_missing_model_exits_2(tmp_path, capsys):
    code, _, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--prompt", "-", "hi")
    assert code == 2 and "no-model" in err


# --------------------------------------------------------------------------------------- demo, memory
def test_demo_on_a_given_model(tiny, tmp_path, capsys):
    code, out, err = run(capsys, "demo", "--model", tiny, "--adapters-dir", tmp_path / "demo", "--max-tokens", 3)
    assert code == 0, err
    for n in DEMO_NAMES:
        assert f"[{n}]" in out and (tmp_path / "demo" / n / "adapter_config.json").is_file()
    assert "[base]" in out and "tokens/s" in out


def test_demo_takes_adapters_above_the_default_max_lora_rank(tmp_path, tmp_path_factory, capsys):
    """make-demo-adapters --rank above the engine's default max_lora_rank (64) says how to load them; demo refuses
    them with the engine's message naming --max-lora-rank, and runs with that flag."""
    tiny = tmp_path / "wide"  # every module at least 96 wide: rank 80 is a rank make-demo-adapters takes
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)).save_pretrained(str(tiny))
    for f in _tokenizer_dir(tmp_path_factory).iterdir():
        shutil.copy(f, tiny)
    code, _, err = run(capsys, "make-demo-adapters", tmp_path / "ad", "--model", tiny, "--rank", 80)
    assert code == 0 and "rank 80 is above the engine's default max_lora_rank 64" in err
    assert "--max-lora-rank 80" in err
    code, _, err = run(capsys, "demo", "--model", tiny, "--adapters-dir", tmp_path / "ad", "--max-tokens", 2)
    assert code != 0 and "exceeds the engine's max_lora_rank 64" in err and "--max-lora-rank 80" in err, err
    code, out, err = run(capsys, "demo", "--model", tiny, "--adapters-dir", tmp_path / "ad", "--max-tokens", 2,
                         "--max-lora-rank", 80)
    assert code == 0, err
    assert all(f"[{n}]" in out for n in DEMO_NAMES)


def test_readme_names_the_demo_adapters_directory_as_the_demo_makes_it(monkeypatch):
    """README.md says where `multilora demo` writes its adapters in one way, `<model file name without .gguf, or model
    directory name>`, and its example is the directory the demo derives for the embedded model (``model_label``);
    a model directory keeps its whole name (dots in it too)."""
    from pathlib import Path

    from multilora.runtime.demo import default_demo_dir
    from multilora.runtime.weights import model_label, resolve_model_path

    readme = Path(__file__).resolve().parent.parent / "README.md"
    if not readme.is_file():
        pytest.skip("no README.md beside tests/")
    text = " ".join(readme.read_text().split())  # (a path in backquotes may be wrapped over two lines)
    placeholders = set(re.findall(r"demo-adapters/(<[^>]*>)", text))
    assert placeholders == {"<model file name without .gguf, or model directory name>"}, placeholders
    monkeypatch.delenv("MULTILORA_HOME", raising=False)
    model = resolve_model_path(None)
    real = default_demo_dir() / model_label(model)
    assert model.suffix == ".gguf" and real.name == model.name[:-len(".gguf")]
    assert f"`~/{real.relative_to(Path.home())}/`" in text, real


def test_model_label_keeps_a_directory_name_whole(tmp_path):
    """``model_label``: a .gguf file loses ``.gguf`` only; a model directory keeps its whole name, so two sizes of
    one family (``Qwen2.5-0.5B-Instruct``, ``Qwen2.5-7B-Instruct``) get two demo directories, not one ``Qwen2``."""
    from multilora.runtime.weights import model_label

    for name in ("Qwen2.5-0.5B-Instruct", "Qwen2.5-7B-Instruct", "plain"):
        (tmp_path / name).mkdir()
        assert model_label(tmp_path / name) == name
    assert model_label(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    (tmp_path / "odd.gguf").mkdir()  # a directory named like a file keeps its name
    assert model_label(tmp_path / "odd.gguf") == "odd.gguf"


def test_memory_json_runs(capsys):
    code, out, err = run(capsys, "memory", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert "plan" in obj and "snapshot" in obj


def test_memory_notes_a_zero_byte_adapter_pool(tmp_path, capsys):
    """A plan with a 0 B pool is printed (exit 0: it may be what was asked for) with a note under it that an engine needs
    room for one adapter; with --min-adapter-bytes the plan itself refuses a cap below that (exit 2)."""
    snap = tmp_path / "snap.json"
    code, out, err = run(capsys, "memory", "--save-snapshot", snap)
    assert code == 0 and "adapter pool is 0 B" not in out, out
    for flags in (["--adapter-pool-bytes", "0"], ["--adapter-pool-share", "0"]):
        code, out, err = run(capsys, "memory", "--snapshot", snap, *flags)
        assert code == 0 and not err, err  # exit 0: nothing on stderr (as test_fuzz_memory_snapshots checks)
        assert "adapter pool is 0 B" in out and "--min-adapter-bytes" in out, out
    code, out, err = run(capsys, "memory", "--snapshot", snap, "--adapter-pool-bytes", "0", "--min-adapter-bytes", "1MiB")
    assert code == 2 and "note" not in out + err, (out, err)
    for flags in (["--kv-bytes", "0"], ["--adapter-pool-share", "1"]):  # the KV cache likewise
        code, out, err = run(capsys, "memory", "--snapshot", snap, *flags)
        assert code == 0 and not err and "KV cache is 0 B" in out and "--min-kv-bytes" in out, (out, err)
    code, out, err = run(capsys, "memory", "--snapshot", snap)
    assert "KV cache is 0 B" not in out and "--model [PATH] plans as an engine" in out, out  # an engine's bounds


def test_memory_says_when_the_reserve_alone_does_not_fit(tmp_path, capsys):
    """A non-KV reserve above the usable memory is refused saying so (not "0 B does not fit in at most 0 B")."""
    snap = tmp_path / "snap.json"
    assert run(capsys, "memory", "--save-snapshot", snap)[0] == 0
    usable = json.loads(run(capsys, "memory", "--snapshot", snap, "--json")[1])["plan"]["usable_bytes"]
    code, out, err = run(capsys, "memory", "--snapshot", snap, "--non-kv-reserve-bytes", str(usable + 5))
    assert code == 2 and "the non-KV reserve" in err and "leaves nothing of the usable memory" in err, err
    assert "it is 5 B too large" in err and "non_kv_reserve_bytes" in err, err


def test_generate_engine_flags(tiny, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "Hi", "--max-tokens", 2,
                         "--adapter-pool-share", "0.2", "--no-cuda-graphs", "--kv-block-size", "4")
    assert code == 0, err
    code, out, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "Hi", "--adapter-pool-share", "1.5")
    assert code == 2 and "--adapter-pool-share: must be a number in (0, 1), got 1.5" in err


def test_chunked_prefill_and_admission_flags():
    """The engine flags of chunked prefill and adapter-aware admission, as EngineConfig fields."""
    import argparse

    from multilora.runtime.config import EngineConfig

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_flags(p)
    c = EngineConfig.from_cli(p.parse_args([]))
    assert (c.enable_chunked_prefill, c.max_num_batched_tokens, c.adapter_aware_admission) == (True, None, True)
    c = EngineConfig.from_cli(p.parse_args(["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512",
                                            "--no-adapter-aware-admission", "--no-cuda-graphs"]))
    assert (c.enable_chunked_prefill, c.max_num_batched_tokens, c.adapter_aware_admission, c.cuda_graphs) == (
        False, 512, False, False)
    assert EngineConfig.from_cli(p.parse_args(["--enable-chunked-prefill"])).enable_chunked_prefill is True
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineConfig(enable_chunked_prefill="yes")


def test_a_chunked_budget_without_chunking_is_said(caplog):
    """``max_num_batched_tokens`` with chunked prefill off does nothing: a warning says so and names the cap that
    applies (an A/B of the two modes may keep its budget, so it is not an error)."""
    from multilora import Engine
    from multilora.config import ModelConfig
    from multilora.runtime.config import EngineConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    with caplog.at_level("WARNING", logger="multilora"):
        Engine(cfg, config=EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=512), device="cpu",
               progress=False)
    said = [r for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(said) == 1  # once per engine (not again for each dataclasses.replace of the config)
    assert "max_num_batched_tokens=512 has no effect with enable_chunked_prefill=False" in said[0].getMessage()
    assert "max_prefill_tokens" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="multilora"):
        EngineConfig(max_num_batched_tokens=512).warn_ineffective()
        EngineConfig(enable_chunked_prefill=False).warn_ineffective()
        EngineConfig(page_rows=8).warn_ineffective()  # the default: said nothing
    assert "no effect" not in caplog.text
    with caplog.at_level("WARNING", logger="multilora"):
        EngineConfig(page_rows=16).warn_ineffective()
    assert "page_rows=16 has no effect: the adapter pool stores each adapter at its exact size" in caplog.text


def test_serve_refuses_a_port_in_use_before_loading(tmp_path, capsys):
    """``multilora serve`` on a port another socket holds fails at once, naming --port, before any model loads
    (the model path here does not even exist: its error would come later)."""
    import socket

    pytest.importorskip("uvicorn")
    from multilora.runtime import cli

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--port {port}: cannot listen on 127.0.0.1"):
            cli._check_port("127.0.0.1", port)
        code, _, err = run(capsys, "serve", "--model", tmp_path / "no-model", "--host", "127.0.0.1", "--port", port)
        assert code != 0 and f"--port {port}: cannot listen on" in err and "no-model" not in err
    cli._check_port("127.0.0.1", port)  # free again: no error
    cli._check_port("", port)  # "": every interface, as asyncio (uvicorn) reads it
    with pytest.raises(ValueError, match="--host"):
        cli._check_port("no-such-host.invalid", 8000)


def test_port_check_binds_every_address_of_the_host(monkeypatch):
    """A host name with two addresses (``localhost`` as ::1 and 127.0.0.1 on some systems) is refused when the
    port is taken on the second one: uvicorn would bind both and fail after the model loaded."""
    import socket

    from multilora.runtime import cli

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))  # all of 127/8 is loopback on Linux
        s.listen(1)
        port = s.getsockname()[1]
        two = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port))]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: two)
        with pytest.raises(ValueError, match=rf"--port {port}: cannot listen on 127.0.0.2"):
            cli._check_port("two.example", port)


def test_unified_pool_flag_and_verbosity_after_the_command(tiny, capsys, caplog):
    """``--unified-pool`` reaches the engine (its stats say so); ``-v`` works after the command as before it, and
    ``-vv`` logs the memory plan (DEBUG)."""
    import argparse
    import logging

    from multilora.runtime.cli import build_parser, log_level, verbosity
    from multilora.runtime.config import EngineConfig

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_flags(p)
    assert EngineConfig.from_cli(p.parse_args([])).unified_pool is False
    assert EngineConfig.from_cli(p.parse_args(["--unified-pool"])).unified_pool is True
    parser = build_parser()
    assert [verbosity(parser.parse_args(a)) for a in (["generate"], ["-v", "generate"], ["generate", "-v"],
                                                      ["generate", "-vv"], ["serve"], ["memory", "-v"],
                                                      ["-v", "generate", "-v"], ["-vv", "memory", "-v"])] == [
        0, 1, 1, 2, 0, 1, 2, 3]
    assert [log_level("generate", v) for v in (0, 1, 2, 3)] == [logging.WARNING, logging.INFO] + [logging.DEBUG] * 2
    assert [log_level("serve", v) for v in (0, 1)] == [logging.INFO, logging.DEBUG]
    caplog.set_level(logging.DEBUG, logger="multilora")  # (pytest's handlers keep basicConfig from setting it)
    code, out, err = run(capsys, "generate", "-vv", "--model", tiny, "--prompt", "-", "Hi", "--max-tokens", 2,
                         "--unified-pool", "--stats", "--kv-block-size", "4")
    assert code == 0, err
    assert "unified pool + KV: one buffer of" in caplog.text and "memory plan:" in caplog.text
    assert "unified_units" in out + err


# ---------------------------------------------------------------------------------- engine flags' defaults
def _option_helps(help_text):
    """{first option string: its invocation and help on one line} of an argparse help."""
    blocks, cur = {}, None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            cur = line.split()[0].rstrip(",")
            blocks[cur] = line
        elif line.startswith("   ") and cur is not None:
            blocks[cur] += " " + line
        else:
            cur = None
    return {k: " ".join(v.split()) for k, v in blocks.items()}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_flag_names_its_default(capsys, monkeypatch, command):
    """Each flag made from an EngineConfig field says its default in its help: ``(default: 16)`` (on / off for a
    --X / --no-X pair); a None default says what None means; a lone --no-X switch (--no-cuda-graphs) needs not, and
    an ignored flag (--page-rows) says it is ignored, not a default."""
    from dataclasses import fields

    from multilora.runtime.config import EngineConfig

    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    helps = _option_helps(out)
    checked = 0
    for f in fields(EngineConfig):
        if not f.metadata.get("cli"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool) and f.metadata["kind"] is not bool:  # --no-cuda-graphs: a switch off
            assert "--no-" + f.name.replace("_", "-") in helps
            continue
        text = helps[flag]
        if f.default is None:
            assert "default" in text, text
            continue
        if f.metadata.get("help", "").startswith("ignored"):  # --page-rows: no default to speak of
            assert "(default" not in text and "ignored" in text, text
            continue
        shown = ("on" if f.default else "off") if isinstance(f.default, bool) else str(f.default)
        assert re.search(rf"\(default:? {re.escape(shown)}\b", text), (flag, text)
        checked += 1
    assert checked >= 15  # (17 when written)
    for flag, words in {"--max-batch-size": "(default: 16)", "--kv-block-size": "(default: 16)",
                        "--max-lora-rank": "(default: 64)", "--max-prefill-tokens": "(default: 4096)",
                        "--gpu-memory-fraction": "(default: 0.9)", "--starvation-patience": "(default: 16)",
                        "--prefetch-adapters": "(default: 4)", "--enable-chunked-prefill": "(default: on)"}.items():
        assert helps[flag].endswith(words), helps[flag]


# ------------------------------------------------------------------------ JSONL prompts before the model
@pytest.mark.parametrize("prompt, words", [
    (5, "prompt: expected a string, a list of chat messages"),
    ([{"role": "bot", "content": "x"}], "prompt: chat message 0: 'role' must be one of"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "prompt: chat message 1: expected a dict with "
                                                                "'role' and 'content', got the keys ['role']"),
    ([{"role": "user", "content": 3}], "prompt: chat message 0: 'content' must be a string, got int"),
    ([1, True], "prompt: token ids must be ints, got bool True at index 1"),
    ([1, -2], "prompt: token ids must be >= 0"),
    ([], "prompt: expected at least one token id"),
    ("\ud800", "prompt: not valid Unicode"),
])
def test_bad_jsonl_prompt_exits_2_before_the_model_loads(tmp_path, capsys, prompt, words):
    """A JSONL line whose prompt is no string, chat messages or token ids is refused naming FILE:LINE, before the
    model (here a path that does not exist: its error would come first otherwise)."""
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    code, out, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--jsonl", f)
    assert code == 2 and out == "" and f"{f}:2: {words}" in err and "no-model" not in err, err
    assert "prompts[" not in err


def test_bad_prompt_text_names_the_flag_before_the_model_loads(tmp_path, capsys):
    code, out, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--prompt", "-", "a\udcff")
    assert code == 2 and "--prompt - 'a\\udcff': prompt: not valid Unicode" in err and "no-model" not in err, err


def test_what_needs_the_model_names_the_jsonl_line(tiny, tmp_path, capsys):
    """A token id past the model's vocabulary is found as the engine takes the prompt: still FILE:LINE, not
    prompts[i]."""
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps({"prompt": [1, 2]}) + "\n" + json.dumps({"prompt": [1, VOCAB]}) + "\n")
    code, out, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--jsonl", f, "--max-tokens", 1)
    assert code == 2 and f"{f}:2: prompt: token ids must be in [0, {VOCAB})" in err and "prompts[" not in err, err


# ------------------------------------------------------------------------------------------ --allow-pickle
@pytest.fixture
def pickled_adapter(demo_dir, tmp_path):
    """demo-a with its weights as adapter_model.bin only (torch.save of the state dict, as peft writes with
    safe_serialization=False)."""
    from safetensors.torch import load_file

    d = tmp_path / "pickled"
    shutil.copytree(demo_dir / "demo-a", d)
    torch.save(load_file(str(d / "adapter_model.safetensors")), d / "adapter_model.bin")
    (d / "adapter_model.safetensors").unlink()
    return d


def test_a_pickled_adapter_is_refused_without_allow_pickle(pickled_adapter, tmp_path, capsys):
    code, out, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--adapter", f"p={pickled_adapter}",
                         "--prompt", "p", "hi")
    assert code == 2 and out == "" and "no-model" not in err, err  # before the model loads
    assert f"--adapter p={pickled_adapter}: {pickled_adapter / 'adapter_model.bin'}: only a pickle" in err, err
    assert "arbitrary code" in err and "pass --allow-pickle" in err, err


def test_bad_adapter_weight_files_are_refused_before_the_model_loads(demo_dir, tmp_path, capsys):
    """What the safetensors header tells without the model: a FIFO or a directory in its place, a truncated file,
    an integer tensor, a rank (a rank_pattern's) above --max-lora-rank: exit 2 naming the flag, the file and the key,
    before the (missing) model is looked for."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    def variant(name, change):
        d = tmp_path / name
        shutil.copytree(demo_dir / "demo-a", d)
        change(d, d / "adapter_model.safetensors")
        return d

    def fifo(d, w):
        w.unlink()
        os.mkfifo(w)

    def truncated(d, w):
        w.write_bytes(w.read_bytes()[:-100])

    def int32(d, w):
        t = load_file(str(w))
        k = sorted(t)[0]
        save_file({**t, k: t[k].to(torch.int32)}, str(w))

    def rank_pattern(d, w):
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, "rank_pattern": {"q_proj": 128}}))
        t = load_file(str(w))
        save_file({k: (torch.zeros(128, v.shape[1]) if "q_proj.lora_A" in k else
                       torch.zeros(v.shape[0], 128) if "q_proj.lora_B" in k else v) for k, v in t.items()}, str(w))

    cases = ((fifo, "expected a file, got a named pipe (FIFO)"), (truncated, "cannot read the safetensors file"),
             (int32, "expected a floating-point dtype"),
             (rank_pattern, "rank 128 (its rows; the config's rank_pattern) exceeds the engine's max_lora_rank 64"))
    for change, words in cases:
        d = variant(change.__name__, change)
        code, out, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--adapter", f"x={d}",
                             "--prompt", "x", "hi")
        assert code == 2 and out == "" and "no-model" not in err, err  # before the model loads
        assert f"--adapter x={d}: {d / 'adapter_model.safetensors'}: " in err and words in err, err


def test_a_pickled_adapter_loads_with_allow_pickle(tiny, engine, pickled_adapter, capsys):
    code, out, err = run(capsys, "generate", "--model", tiny, "--adapter", f"p={pickled_adapter}", "--allow-pickle",
                         "--prompt", "p", "hi", "--prompt", "-", "hello", "--max-tokens", 4, "--json")
    assert code == 0, err
    objs = _json_lines(out)
    assert [o["token_ids"] for o in objs] == _greedy(engine, ["hi", "hello"], ["demo-a", None], 4)


def test_allow_pickle_help_warns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    _, out, _ = run(capsys, "generate", "--help")
    text = _option_helps(out)["--allow-pickle"]
    assert "adapter_model.bin" in text and "SECURITY" in text and "run code from the file" in text, text


def test_serve_refuses_a_pickled_adapter_before_loading(pickled_adapter, tmp_path, capsys):
    """Without --allow-pickle, serve refuses a pickle-only adapter before the model loads, naming the flag."""
    import socket

    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run(capsys, "serve", "--model", tmp_path / "no-model", "--port", port,
                       "--adapter", f"p={pickled_adapter}")
    assert code == 2 and "only a pickle" in err and "pass --allow-pickle" in err, err
    assert "no-model" not in err


def test_serves_engine_factory_loads_a_pickled_adapter_with_allow_pickle(tiny, engine, pickled_adapter):
    """``serve --allow-pickle`` builds its engine (in a child process, or in-process) with
    ``load_engine(..., allow_pickle=True)``: the pickled copy of demo-a serves demo-a's tokens; without it, refused."""
    from multilora.runtime.config import EngineConfig
    from multilora.runtime.engine_process import load_engine

    with pytest.raises(ValueError, match=r"--adapter p=.*only a pickle.*--allow-pickle"):
        load_engine(tiny, EngineConfig(progress=False), [("p", str(pickled_adapter))])
    e = load_engine(tiny, EngineConfig(progress=False), [("p", str(pickled_adapter))], allow_pickle=True)
    try:
        assert _greedy(e, ["hi"], ["p"], 4) == _greedy(engine, ["hi"], ["demo-a"], 4)
    finally:
        e.close()


def test_serve_help_offers_allow_pickle(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    _, out, _ = run(capsys, "serve", "--help")
    text = _option_helps(out)["--allow-pickle"]
    assert "SECURITY" in text and "not for adapters loaded at run time" in text, text


# ------------------------------------------------------------------------------------------ serve-ray's early checks
@pytest.mark.parametrize("key, why", [("", "0 characters (empty)"), (" sk-1", "5 characters (whitespace at an end)")])
def test_an_empty_api_key_is_refused_before_loading(tmp_path, capsys, monkeypatch, key, why):
    """``--api-key ''`` (or ``MULTILORA_API_KEY=``) would turn authentication on with an empty key (only a blank
    ``Bearer`` header passing) while the start-up warning says no key is set: it is refused, exit status 2, naming
    the flag and never echoing the key, before the model (here missing) is looked at; so are ``create_app`` and
    ``RayAppSpec`` given such a key. No key at all still serves without authentication."""
    import sys

    pytest.importorskip("fastapi")
    from multilora.runtime.ray_serve import RayAppSpec
    from multilora.runtime.server import create_app

    monkeypatch.setitem(sys.modules, "ray", None)
    for cmd in ("serve", "serve-ray"):
        code, _, err = run(capsys, cmd, "--model", tmp_path / "no-model", "--api-key", key)
        assert code == 2 and f"--api-key (default: $MULTILORA_API_KEY): expected a non-empty string" in err, err
        assert why in err and "no-model" not in err, err
        if key.strip():
            assert key.strip() not in err
    monkeypatch.setenv("MULTILORA_API_KEY", key)  # the flag's default
    code, _, err = run(capsys, "serve", "--model", tmp_path / "no-model")
    assert code == 2 and "--api-key (default: $MULTILORA_API_KEY)" in err and why in err, err
    with pytest.raises(ValueError, match=r"^api_key: expected a non-empty string"):
        create_app(None, served_model_name="base", api_key=key)
    with pytest.raises(ValueError, match=r"^RayAppSpec.api_key: expected a non-empty string"):
        RayAppSpec(api_key=key)
    with pytest.raises(ValueError, match=r"api_key: .* got bytes \(not a string\)") as ei:
        create_app(None, served_model_name="base", api_key=b"sk-secret")
    assert "secret" not in str(ei.value)
    with pytest.raises(ValueError, match=r"api_key: .* got 7 characters \(a character an HTTP header cannot carry"):
        create_app(None, served_model_name="base", api_key="sk-\u043a\u043b\u044e\u0447")
    assert RayAppSpec(api_key=None).api_key is None and RayAppSpec(api_key="k").api_key == "k"


def test_serve_ray_checks_what_replicas_would_refuse_before_ray_starts(pickled_adapter, demo_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """serve-ray fails in a second, naming the flag, on what its replicas would only find after Ray has started: a
    missing model, an adapter named as the default model's served name, a pickle-only adapter (replicas load none:
    not told to pass a flag serve-ray lacks), an adapter of a rank past --max-lora-rank, and on a cluster of its own
    a device this host lacks or a port in use. Ray itself is never imported here."""
    import sys

    from multilora.runtime.weights import resolve_model_path

    monkeypatch.setitem(sys.modules, "ray", None)  # reaching Ray would fail with "ray is not installed"
    code, _, err = run(capsys, "serve-ray", "--model", tmp_path / "no-model")
    missing = tmp_path / "no-model"
    assert code == 2 and f"--model {missing}: path {str(missing)!r} does not exist" in err, err
    stem = resolve_model_path(None).stem
    code, _, err = run(capsys, "serve-ray", "--adapter", f"{stem}={demo_dir / 'demo-a'}")
    assert code == 2 and f"--adapter {stem}=...: that name is the base model's served name" in err, err
    code, _, err = run(capsys, "serve-ray", "--adapter", f"p={pickled_adapter}")
    assert code == 2 and f"--adapter p={pickled_adapter}: {pickled_adapter / 'adapter_model.bin'}: only a pickle" \
        in err and "serve-ray's replicas load no pickle" in err and "--allow-pickle`" in err, err
    if not torch.cuda.is_available():  # a device this host lacks, on a cluster of our own
        code, _, err = run(capsys, "serve-ray", "--adapter", f"a={demo_dir / 'demo-a'}", "--device", "cuda")
        assert code == 2 and err.count("--device: ") == 1 and "CUDA is not available" in err, err
    import socket

    with socket.socket() as s:  # a port in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run(capsys, "serve-ray", "--adapter", f"a={demo_dir / 'demo-a'}", "--host", "127.0.0.1",
                           "--port", port)
    assert code == 2 and f"--host 127.0.0.1 --port {port}: cannot listen" in err, err
    code, _, err = run(capsys, "serve-ray", "--adapter", f"a={demo_dir / 'demo-a'}", "--max-lora-rank", "1")
    assert code == 2 and f"--adapter a={demo_dir / 'demo-a'}: " in err and "max_lora_rank" in err, err
    code, _, err = run(capsys, "serve-ray", "--tensor-parallel-size", "2")  # taken, refused, not in --help
    assert code == 2 and "--tensor-parallel-size 2: not supported by serve-ray" in err, err
    code, out, _ = run(capsys, "serve-ray", "--help")
    assert code == 0 and "--replicas" in out and "--tensor-parallel-size" not in out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed
    code, _, err = run(capsys, "serve-ray", "--adapter", f"a={demo_dir / 'demo-a'}", "--host", "127.0.0.1",
                       "--port", port)
    assert code == 2 and "ray is not installed" in err, err  # every check passed: on to Ray


def test_ctrl_c_ends_a_command_with_one_line(capsys, monkeypatch):
    """Ctrl-C while a command loads or generates: one line and exit status 130, not a traceback."""
    import multilora.runtime.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_generate", interrupted)
    code, out, err = run(capsys, "generate", "--prompt", "-", "hi")
    assert code == 130 and err.strip() == "multilora generate: interrupted" and out == "", err


def test_serve_warns_about_runtime_adapters_without_a_root(capsys, caplog, tmp_path):
    """--allow-runtime-adapters without --adapter-root lets a client load any readable directory: said at start (here
    the port in use then stops the command before the model loads); --adapter-root alone has no effect: said too."""
    import socket

    pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        base = ["serve", "--model", tmp_path / "no-model", "--served-model-name", "m", "--host", "127.0.0.1",
                "--port", port]
        with caplog.at_level("WARNING", logger="multilora"):
            code, _, err = run(capsys, *base, "--allow-runtime-adapters")
            assert code == 2 and "cannot listen" in err, err
            assert "--allow-runtime-adapters without --adapter-root: any client (no --api-key) may load any adapter " \
                   "directory" in caplog.text
            caplog.clear()
            code, _, err = run(capsys, *base, "--adapter-root", tmp_path)
            assert code == 2 and f"--adapter-root {tmp_path} has no effect without --allow-runtime-adapters" in \
                caplog.text
            caplog.clear()
            code, _, err = run(capsys, *base, "--adapter-root", tmp_path, "--allow-runtime-adapters")
            assert code == 2 and "adapter-root" not in caplog.text
        for bad in ("", " m", "a,b"):  # requests carry it in "model", as adapters' names: the same rule
            code, _, err = run(capsys, *base[:-6], "--served-model-name", bad, *base[-4:])
            assert code == 2 and f"--served-model-name must be a non-empty string" in err and repr(bad) in err, err


def test_output_dirs_that_cannot_hold_adapters_are_refused_before_the_model_loads(tmp_path, capsys):
    """make-demo-adapters OUT_DIR and demo --adapters-dir naming a file, or a path under a file: exit 2 naming it,
    with the (missing) model never looked for."""
    f = tmp_path / "a-file"
    f.write_text("x")
    for argv, words in ((("make-demo-adapters", f, "--model", tmp_path / "no-model"), f"OUT_DIR {f}: not a directory"),
                        (("make-demo-adapters", f / "sub", "--model", tmp_path / "no-model"),
                         f"OUT_DIR {f / 'sub'}: {f} is not a directory"),
                        (("demo", "--adapters-dir", f, "--model", tmp_path / "no-model"),
                         f"--adapters-dir {f}: not a directory")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and words in err and "no-model" not in err, err


def test_memory_errors_name_the_flag(tmp_path, capsys):
    """``multilora memory``'s option errors name its flags, not the plan's fields; a missing --model names it."""
    for argv, words in ((("--local-ranks", 0), "--local-ranks: expected an integer >= 1, got 0"),
                        (("--fraction", 0), "--fraction: expected 0 < fraction <= 1"),
                        (("--model", tmp_path / "nope"), f"--model {tmp_path / 'nope'}: path ")):
        code, out, err = run(capsys, "memory", *argv)
        assert code == 2 and f"multilora memory: error: {words}" in err, err


def test_header_check_leaves_rows_the_config_does_not_give_to_the_loader(demo_dir, tmp_path, capsys):
    """A lora_A with more rows than the config's r (no rank_pattern): not a max_lora_rank problem (raising it would
    not help): the header check lets it through, and the loader's shape check names it at the load (here the missing
    model is what stops the command)."""
    import json

    from safetensors.torch import load_file, save_file

    d = tmp_path / "rows"
    shutil.copytree(demo_dir / "demo-a", d)
    w = d / "adapter_model.safetensors"
    t = load_file(str(w))
    save_file({k: (torch.zeros(128, v.shape[1]) if "q_proj.lora_A" in k else v) for k, v in t.items()}, str(w))
    assert json.loads((d / "adapter_config.json").read_text())["r"] < 128
    code, out, err = run(capsys, "generate", "--model", tmp_path / "no-model", "--adapter", f"x={d}", "--prompt", "x",
                         "hi")
    assert code == 2 and "no-model" in err and "max_lora_rank" not in err, err


def test_engine_errors_name_only_flags_the_command_has(tmp_path, capsys, monkeypatch):
    """An ``Engine: <field>`` error after the model loads names the flag in generate; a message whose first word is
    no EngineConfig field, or a command without engine flags (demo), keeps its words."""
    import multilora.runtime.cli as cli
    import multilora.runtime.demo as demo

    for msg, want in (("Engine: kv_cache_bytes=1 holds 0 blocks", "--kv-cache-bytes: 1 holds 0 blocks"),
                      ("Engine: kv_cache_bytes=1 is small: raise kv_cache_bytes (kv_cache_bytes=1)",
                       "--kv-cache-bytes: 1 is small: raise --kv-cache-bytes (kv_cache_bytes=1)"),
                      ("Engine: the KV cache gets 0 blocks", "Engine: the KV cache gets 0 blocks")):
        monkeypatch.setattr(cli, "_load_engine", lambda args, msg=msg, **k: (_ for _ in ()).throw(ValueError(msg)))
        code, _, err = run(capsys, "generate", "--prompt", "-", "hi")
        assert code == 2 and err.strip().endswith(want), err
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: (_ for _ in ()).throw(ValueError("Engine: device='x' bad")))
    code, _, err = run(capsys, "demo")
    assert code == 2 and "Engine: device='x' bad" in err, err


@pytest.mark.parametrize("command", ["generate", "serve", "serve-ray"])
def test_engine_byte_flags_take_the_units_memory_takes(command, capsys):
    """A size copied from ``multilora memory`` (``--kv-bytes 8GiB``) works in every command with engine flags: each
    ``*_bytes`` flag reads a count or a number with a unit, as ``parse_bytes``; a bad one names the flag."""
    from multilora.runtime.cli import build_parser
    from multilora.runtime.cli_memory import parse_bytes

    p = build_parser()
    flags = {"--kv-cache-bytes": "1GiB", "--adapter-pool-bytes": "512MiB", "--host-adapter-bytes": "1.5GB",
             "--host-arena-map-ahead-bytes": "4096"}
    args = p.parse_args([command, *[x for kv in flags.items() for x in kv]])
    got = {f: getattr(args, f[2:].replace("-", "_")) for f in flags}
    assert got == {f: parse_bytes(v) for f, v in flags.items()} == {
        "--kv-cache-bytes": 1 << 30, "--adapter-pool-bytes": 512 << 20, "--host-adapter-bytes": 1_500_000_000,
        "--host-arena-map-ahead-bytes": 4096}
    with pytest.raises(SystemExit):
        p.parse_args([command, "--kv-cache-bytes", "8 gigs"])
    err = capsys.readouterr().err
    assert "argument --kv-cache-bytes: expected a byte count like 4096, 512MiB or 2GiB, got '8 gigs'" in err, err


def test_check_output_dir_needs_write_access_only_to_write(tmp_path, monkeypatch):
    """``demo --adapters-dir`` over a directory holding every demo adapter needs no write access (nothing is
    written); a directory that must receive adapters does."""
    from multilora.runtime.demo import check_output_dir

    monkeypatch.setattr("multilora.runtime.demo.os.access", lambda *a: False)
    check_output_dir(tmp_path, "--adapters-dir", writable=False)
    with pytest.raises(ValueError, match=rf"--adapters-dir {tmp_path}/new: {tmp_path} is not writable"):
        check_output_dir(tmp_path / "new", "--adapters-dir")


def test_text_prompts_that_get_no_tokens_suggest_chat(tiny, capsys, monkeypatch):
    """An instruct model given raw text often ends at once: ``generate`` then notes on stderr that ``--chat`` applies
    the chat template; not with ``--chat``, not when tokens came, not for a tokenizer without a chat template."""
    import types

    import multilora.runtime.cli as cli
    from multilora.runtime.postprocess import RequestOutput

    def fake(template, tokens):
        class E:
            tokenizer = types.SimpleNamespace(chat_template=template)
            last_run = {"generated_tokens": len(tokens), "seconds": 0.1, "tokens_per_second": 10.0}

            def generate(self, prompts, adapters, sampling, progress):
                return [RequestOutput(request_id=i, prompt=p, adapter=a, text="x" * len(tokens), token_ids=list(tokens),
                                      prompt_token_ids=[1], finish_reason="stop") for i, (p, a) in
                        enumerate(zip(prompts, adapters))]
        return lambda args, **k: E()

    for template, tokens, chat, noted in (("{{ messages }}", [], False, True), ("{{ messages }}", [], True, False),
                                          ("{{ messages }}", [5], False, False), (None, [], False, False)):
        monkeypatch.setattr(cli, "_load_engine", fake(template, tokens))
        code, out, err = run(capsys, "generate", "--model", tiny, "--prompt", "-", "hi", "--prompt", "-", "yo",
                             *(["--chat"] if chat else []))
        assert code == 0, err
        assert ("note: 2 text prompt(s) got no tokens (the model ended at once)" in err) == noted, (template, tokens,
                                                                                                    chat, err)
        assert ("add --chat" in err) == noted

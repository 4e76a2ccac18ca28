"""Fixtures for the serving tests: tiny decoders compiled once, a tokenizer built from a word
list (with a chat template), and the server started as users start it: `aviatorc serve` in a
subprocess on 127.0.0.1, an ephemeral port read from its ready line."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import aviatorc
from aviatorc import zoo
from aviatorc.serve.server import READY

CONTEXT = 512  # long enough that a stream holds its slot for seconds (the queue and disconnect tests)
SLOTS = 4
EOS = 2
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def compile_decoder(arch: str, out: Path, *, chiplets: str | None = None, batch: int = SLOTS) -> Path:
    model = zoo.build_model(arch).inner.eval()
    model.config.max_position_embeddings = CONTEXT  # rotary positions: the zoo's 64 are only its default
    result = aviatorc.compile(model, target="mock", context=CONTEXT, prompt=8, batch=batch, time_limit_s=1.0,
                              chiplets=chiplets)
    return result.save(out)


ARTIFACTS = {  # name -> (arch, chiplets)
    "llama": ("llama", None),  # every chiplet
    "left": ("llama", "0-1"),  # two tenants on disjoint chiplets
    "right": ("qwen2", "2-3"),
    "draft": ("qwen2", None),  # a draft for llama (the same 128-token vocabulary)
}


class _Artifacts(dict):
    """Compiled on first use, once per test session."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        arch, chiplets = ARTIFACTS[name]
        self[name] = compile_decoder(arch, self.root / f"{name}.avc", chiplets=chiplets)
        return self[name]


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    return _Artifacts(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer over the zoo's 128 ids: '<unk>' '<s>' '</s>' and role markers, then w5..w127."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {**{t: i for i, t in enumerate(specials)}, **{f"w{i}": i for i in range(len(specials), zoo.VOCAB_SIZE)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(folder)
    return folder


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]
    stderr: Path

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


@contextlib.contextmanager
def start_server(*args: str, log: Path, wait_s: float = 120) -> Iterator[Server]:
    """`aviatorc serve ARGS --port 0`; yields once /health answers 200; stops it (and checks it stopped)."""
    with log.open("w") as err:
        process = subprocess.Popen([sys.executable, "-m", "aviatorc", "serve", *args, "--host", "127.0.0.1",
                                    "--port", "0"], stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        url = _ready_url(process, lines, wait_s, log)
        server = Server(url, process, log)
        with server.client() as client:
            assert client.get("/health").status_code == 200
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready_url(process: subprocess.Popen[str], lines: queue.Queue[str], wait_s: float, log: Path) -> str:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if process.poll() is not None:
                raise AssertionError(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}") from None
            continue
        if line.startswith(READY):
            return line.split()[len(READY.split())]
    raise AssertionError(f"the server did not get ready in {wait_s} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory) -> Path:
    """A character tokenizer over the zoo's 128 ids: '<unk>' '<s>' '</s>', then ASCII 3..127 one
    character a token (byte fallback, so llguidance reads each token's bytes): JSON can be spelled."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS}
    vocab |= {chr(i) if 32 <= i < 127 else f"<0x{i:02X}>": i for i in range(3, zoo.VOCAB_SIZE)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    core.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    folder = tmp_path_factory.mktemp("char-tokenizer")
    tok.save_pretrained(folder)
    return folder

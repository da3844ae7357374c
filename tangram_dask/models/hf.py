"""A Hugging Face reward-model adapter: a sequence classifier whose first logit is the reward.

The usual shape of an RL reward model (an ``AutoModelForSequenceClassification``
with one label): ``sequence_classifier(path)`` returns a picklable loader; the
worker calls it with the granted devices and it loads the weights from
``path`` straight onto them (``device_map``, through ``accelerate``: no copy
in host memory first). A replica granted several GPUs (a 140 GB model on two
80 GB GPUs of one NVLink group) has its layers spread over exactly those GPUs
(``device_map="auto"`` with ``max_memory`` naming only them).

``score(batch)``: each item is ``(prompt, response)``, ``{"prompt",
"response"}``, a conversation (a list of ``{"role", "content"}``) or one
string (the whole conversation, already formatted); the result is the first
logit of each, as floats. Where the tokenizer has a chat template (decoder-only
reward models), a pair is scored as the conversation user: prompt, assistant:
response, formatted by it; else as a text pair. In batches of ``batch_size``.
An item longer than ``max_length`` tokens (default: the model's context) is
cut, and a warning says how many were: a templated one from its start (the
reward is read at its last token, the response's end), a text pair from the
longer text's end.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ModelError

logger = logging.getLogger(__name__)

# One load at a time in a process: transformers' lazy module is not safe to import from two threads at once, and
# from_pretrained sets torch's default dtype for the whole process while it builds the model, so two loads at once
# (two GPUs of one worker) gave each other float32 weights where bfloat16 was asked (3 of 4 such loads here).
# The sentence-transformers adapter imports under it too (it imports transformers).
_LOAD = threading.Lock()


def _import_transformers() -> None:
    """transformers' classes the adapter uses, and accelerate (under ``_LOAD``), offline (huggingface_hub reads
    the setting as it is imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with _LOAD:
        import accelerate  # noqa: F401  (device_map needs it)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401


def _item(item: Any) -> tuple[str, str | None] | list[dict]:
    """One batch item: ``(text, None)``, ``(prompt, response)``, or a conversation (a list of role/content dicts)."""
    if isinstance(item, str):
        return item, None
    if isinstance(item, dict) and "prompt" in item and "response" in item:
        return str(item["prompt"]), str(item["response"])
    if isinstance(item, (tuple, list)) and len(item) == 2 and not any(isinstance(x, dict) for x in item):
        return str(item[0]), str(item[1])
    if isinstance(item, list) and item and all(isinstance(m, dict) and "role" in m and "content" in m for m in item):
        return list(item)
    raise ModelError(f"a reward-model batch item must be (prompt, response), {{'prompt', 'response'}}, one string or "
                     f"a conversation (a list of {{'role', 'content'}}), got {type(item).__name__}")


class SequenceClassifierScorer:
    """A loaded reward model: ``score([(prompt, response), ...]) -> [reward, ...]``. Its parameter bytes are
    its torch module's (``residency.param_bytes`` reads them).

    With ``chat`` (the tokenizer has a chat template, and the loader did not turn it off), a ``(prompt,
    response)`` pair is scored as the conversation user: prompt, assistant: response, formatted by that template,
    as decoder-only reward models expect; a conversation item likewise. Without it, a pair is tokenized as a
    text pair (what encoder models such as BERT cross-encoders expect)."""

    def __init__(self, model: Any, tokenizer: Any, device: str, batch_size: int, max_length: int,
                 chat: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device  # where inputs go: the device of the first layer
        self.batch_size = batch_size
        self.max_length = max_length
        self.chat = chat
        self.truncated = 0  # items cut to max_length tokens, so far
        if chat:  # keep the end: the classifier reads the last token
            tokenizer.truncation_side = "left"

    def _format(self, item: tuple[str, str | None] | list[dict]) -> tuple[str, str | None]:
        """(text, second text or None): with ``chat``, one text formatted by the template (a string item is
        taken as formatted already)."""
        if isinstance(item, tuple) and (item[1] is None or not self.chat):
            return item
        if not self.chat:
            raise ModelError("a conversation item needs a tokenizer with a chat template; this model's has none: "
                             "score (prompt, response) pairs or formatted strings")
        messages = item if isinstance(item, list) else [{"role": "user", "content": item[0]},
                                                          {"role": "assistant", "content": item[1]}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False), None

    def _cut(self, chunk: list[tuple[str, str | None]], lengths: list[int], special: bool) -> int:
        """How many items of ``chunk`` the tokenizer cut: those at ``max_length`` tokens, told again uncut."""
        n = 0
        for (a, b), k in zip(chunk, lengths):
            if k >= self.max_length:
                ids = self.tokenizer(a, b, add_special_tokens=special, truncation=False)["input_ids"]
                n += len(ids) > self.max_length
        return n

    def score(self, batch: Sequence[Any]) -> list[float]:
        import torch

        items = [self._format(_item(x)) for x in batch]
        out: list[float] = []
        for i in range(0, len(items), self.batch_size):
            chunk = items[i:i + self.batch_size]
            firsts = [a for a, _ in chunk]
            seconds = [b for _, b in chunk]
            # a chat template writes the special tokens itself (and a formatted string has them)
            kw = {"padding": True, "truncation": True, "max_length": self.max_length, "return_tensors": "pt",
                  "add_special_tokens": not self.chat}
            if all(b is None for b in seconds):
                enc = self.tokenizer(firsts, **kw)
            else:
                enc = self.tokenizer(firsts, [b or "" for b in seconds], **kw)
            cut = self._cut(chunk, enc["attention_mask"].sum(dim=1).tolist(), kw["add_special_tokens"])
            if cut:
                if not self.truncated:
                    logger.warning("tangram: %d of %d reward-model items reached max_length = %d tokens and were "
                                   "cut (%s); later cuts are counted in the scorer's `truncated`", cut, len(chunk),
                                   self.max_length, "their start dropped" if self.chat else "pairs cut at the end")
                self.truncated += cut
            enc = {k: v.to(self.device) for k, v in enc.items()}
            with torch.inference_mode():
                logits = self.model(**enc).logits
            out.extend(logits[:, 0].float().cpu().tolist())
        return out


def _device_map(devices: tuple[str, ...]) -> tuple[Any, dict | None]:
    """(device_map, max_memory) for ``from_pretrained``: one device as is; several CUDA devices as "auto" over them."""
    if len(devices) <= 1:
        return (devices[0] if devices else "cpu"), None
    if not all(d.startswith("cuda:") for d in devices):
        return devices[0], None  # several abstract GPUs of a CPU-only worker: one copy on the CPU
    import torch

    budget = {}
    for d in devices:
        k = int(d.split(":")[1])
        free, _ = torch.cuda.mem_get_info(k)
        budget[k] = int(free)
    return "auto", budget


def _check_placement(device_map: dict | None, devices: tuple[str, ...], path: str) -> None:
    """Every part of a model spread over several CUDA devices must sit on one of them: accelerate puts what does
    not fit on the CPU or disk, which would hold host memory and score slowly, unaccounted."""
    if not device_map or not all(d.startswith("cuda:") for d in devices):
        return
    granted = {int(d.split(":")[1]) for d in devices}
    off = {name: where for name, where in device_map.items()
           if not (isinstance(where, int) and where in granted) and str(where) not in devices}
    if off:
        some = ", ".join(f"{n or '(all)'} -> {w}" for n, w in list(off.items())[:4])
        raise ModelError(f"{path}: does not fit the granted GPUs {list(devices)} ({len(off)} part(s) placed "
                         f"elsewhere: {some}): register it with a larger memory_gb or more units")


@dataclass(frozen=True)
class SequenceClassifierLoader:
    """Loads a sequence-classification reward model from ``path`` onto the granted devices."""

    path: str
    dtype: str = "auto"
    batch_size: int = 16
    max_length: int | None = None  # None: the model's context (max_position_embeddings)
    chat_template: bool | None = None  # None: use the tokenizer's chat template where it has one

    def prepare(self) -> None:
        """What a load needs imported, without loading the weights (the worker calls it on registration):
        transformers and accelerate, then the model's own class (its config names it; transformers imports
        it on first use) and its tokenizer. Here, 3.2 s of imports and 2.1 s for the class, then 0.2 s a load."""
        self._check_dir()
        _import_transformers()
        with _LOAD:
            from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

            config = AutoConfig.from_pretrained(self.path)
            AutoModelForSequenceClassification._model_mapping[type(config)]  # imports the model's module
            AutoTokenizer.from_pretrained(self.path)

    def _check_dir(self) -> None:
        """The model's directory is read on the worker: one that is not there is named as such (transformers
        would read the path as a Hub repo id and say "Repo id must be in the form ..." instead)."""
        if not os.path.isdir(self.path):
            raise ModelError(f"sequence_classifier: {self.path!r} is not a directory on this worker "
                             f"({socket.gethostname()}); give the directory of a model saved with save_pretrained, "
                             "present on every GPU worker")

    def __call__(self, devices: tuple[str, ...]) -> SequenceClassifierScorer:
        self._check_dir()
        _import_transformers()
        with _LOAD:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
            try:  # no progress bars in worker logs
                from transformers.utils import logging as hf_logging
                hf_logging.disable_progress_bar()
            except Exception:  # an older transformers: bars stay, nothing else changes
                pass

            device_map, max_memory = _device_map(tuple(devices))
            kw: dict[str, Any] = {"device_map": device_map}
            if max_memory is not None:
                kw["max_memory"] = max_memory
            model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=self.dtype, **kw)
            tokenizer = AutoTokenizer.from_pretrained(self.path)
        model.eval()
        _check_placement(getattr(model, "hf_device_map", None), tuple(devices), self.path)
        if getattr(model.config, "num_labels", 1) < 1:
            raise ModelError(f"{self.path}: the model has no output label to read a reward from")
        if tokenizer.pad_token is None:  # decoder-only reward models often ship without one
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token is None:
            raise ModelError(f"{self.path}: the tokenizer has neither a pad token nor an end-of-sequence token to "
                             f"pad batches with: set pad_token in its tokenizer_config.json")
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.chat_template and not has_template:
            raise ModelError(f"{self.path}: chat_template=True, but its tokenizer has no chat template")
        chat = has_template if self.chat_template is None else bool(self.chat_template)
        limit = self.max_length or int(getattr(model.config, "max_position_embeddings", 0) or 0) or 2048
        first = next(model.parameters()).device
        return SequenceClassifierScorer(model, tokenizer, str(first), self.batch_size, limit, chat)


def sequence_classifier(path: str, *, dtype: str = "auto", batch_size: int = 16, max_length: int | None = None,
                        chat_template: bool | None = None) -> SequenceClassifierLoader:
    """The loader of a Hugging Face sequence-classification reward model in directory ``path``.

    ``chat_template``: score ``(prompt, response)`` as a conversation formatted by the tokenizer's chat template
    (None, the default: where the tokenizer has one; True: it must; False: text pairs)."""
    if not path:
        raise ModelError("sequence_classifier needs the model's directory")
    return SequenceClassifierLoader(str(path), dtype, batch_size, max_length, chat_template)

"""OpenAI chat messages -> model inputs for a Qwen2-VL-style model.

``load_processor(path)`` returns transformers' ``AutoProcessor`` when it loads, else
``VisionChatProcessor``: the same steps from the tokenizer and the image processor alone
(transformers 5 needs torchvision for Qwen2-VL's video processor, and torchvision's PyPI wheels
do not load on a CPU-only torch). Both give the same ``input_ids``, ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids``.

``openai_to_chat`` turns OpenAI content parts into the chat template's parts and decodes the
images (base64 data URLs, or local file paths for trainers reading stored episodes).
``encode_chat`` builds the prompt inputs: the server's and the trainer's (osfarm.trainer.learner
appends the sampled response to its result), one function, so a trainer's forward pass reproduces
the server's log-probs (tests/test_policy_server.py checks it).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from osfarm.errors import OsfarmError


class MessageError(OsfarmError, ValueError):
    """A chat message the model cannot take; ``field`` says which part of the request (JSON path)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class ChatInputs:
    """A chat ready for the processor: template messages (image parts as placeholders) + images."""

    messages: list[dict[str, Any]]
    images: list[Any]  # PIL images, in order of appearance


def decode_image_url(url: str, field: str):
    """A ``data:image/...;base64,...`` URL (or a local path / file:// URL) -> RGB PIL image."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or ";base64" not in header:
            raise MessageError(field, "data URL must look like data:image/png;base64,<payload>")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MessageError(field, "the data URL's payload is not valid base64") from None
        source: Any = io.BytesIO(raw)
    elif url.startswith(("file://", "/")):
        path = Path(url.removeprefix("file://"))
        if not path.is_file():
            raise MessageError(field, f"image file {path} does not exist")
        source = path
    elif url.startswith(("http://", "https://")):
        raise MessageError(field, "remote image URLs are not fetched: send the image as a base64 data URL")
    else:
        raise MessageError(field, "expected a base64 data URL (data:image/png;base64,...)")
    try:
        with Image.open(source) as img:
            return img.convert("RGB")
    except Image.DecompressionBombError as e:
        raise MessageError(field, f"image too large ({e})") from None
    except UnidentifiedImageError:
        raise MessageError(field, "not a readable image (send PNG, JPEG or WebP bytes)") from None
    except OSError as e:
        raise MessageError(field, f"not a readable image ({e})") from None


def openai_to_chat(messages: list[dict[str, Any]]) -> ChatInputs:
    """OpenAI chat messages (content a string or a list of text / image_url parts) -> ChatInputs.

    Messages are plain dicts (already validated for shape by the API's pydantic models).
    """
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        role = msg.get("role")
        if content is None:
            content = ""
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                if not isinstance(url, str):
                    raise MessageError(f"{where}.image_url.url", "missing image URL")
                images.append(decode_image_url(url, f"{where}.image_url.url"))
                parts.append({"type": "image"})
            else:
                raise MessageError(f"{where}.type", f"unsupported content part type {kind!r} (text, image_url)")
        out.append({"role": role, "content": parts})
    return ChatInputs(out, images)


class VisionChatProcessor:
    """The Qwen2-VL processor's job done with a tokenizer and an image processor only."""

    def __init__(self, tokenizer, image_processor, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError("the tokenizer has no <|image_pad|> token: not a Qwen2-VL-style model")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VisionChatProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        path = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        image_processor = AutoImageProcessor.from_pretrained(path)
        template = None
        for name in ("chat_template.jinja",):
            if (path / name).is_file():
                template = (path / name).read_text()
        return cls(tokenizer, image_processor, template)

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True, **kw) -> str:
        if tokenize:
            raise ValueError("VisionChatProcessor.apply_chat_template renders text only: call it with "
                             "tokenize=False, then the processor")
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **kw,
        )

    def __call__(self, text, images=None, return_tensors: str = "pt", **kw):
        import torch
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        data: dict[str, Any] = {}
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            data.update(vision)
            merge = self.image_processor.merge_size**2
            counts = iter([int(g.prod()) // merge for g in vision["image_grid_thw"]])
            expanded = []
            for t in texts:
                pieces = t.split(self.image_token)
                buf = pieces[0]
                for rest in pieces[1:]:
                    try:
                        buf += self.image_token * next(counts) + rest
                    except StopIteration:
                        raise ValueError("more image placeholders in the text than images") from None
                expanded.append(buf)
            if next(counts, None) is not None:
                raise ValueError("more images than image placeholders in the text")
            texts = expanded
        enc = self.tokenizer(texts, return_tensors="pt", padding=len(texts) > 1)
        data["input_ids"] = enc["input_ids"]
        data["attention_mask"] = enc["attention_mask"]
        data["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).to(torch.int32)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def decode(self, *args, **kwargs) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args, **kwargs) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)


def load_processor(path: str | Path):
    """``AutoProcessor`` for the model dir, or ``VisionChatProcessor`` where it cannot load."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(path)
        if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
            return processor
    except (ImportError, ValueError, TypeError, AttributeError, OSError):
        pass
    return VisionChatProcessor.from_pretrained(path)


def encode_chat(processor, messages: list[dict[str, Any]]):
    """OpenAI chat messages -> the model's prompt inputs, exactly as the policy server builds them
    (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``)."""
    chat = openai_to_chat(messages)
    text = processor.apply_chat_template(chat.messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=chat.images or None, return_tensors="pt")

"""Which chat template a processor renders with, and what a failing template becomes.

Qwen2.5-VL-3B-Instruct ships a text-only chat template in ``tokenizer_config.json`` and the VL
one in ``chat_template.json``; rendering image parts with the first raises ``TypeError: can only
concatenate str (not "list") to str``. transformers' ``AutoProcessor`` renders with the
processor's template, so a VL processor here takes: the override (``--chat-template``), else
chat_template.json, else chat_template.jinja (the order ``ProcessorMixin.get_processor_dict``
reads them in; it is the oracle below), else the tokenizer's.

``tests/fixtures/qwen2_5_vl_3b_instruct/`` holds the two files of Qwen/Qwen2.5-VL-3B-Instruct
byte for byte (its config.json: qwen2_5_vl, hidden 2048, 36 layers), as the public GitHub repo
techshoww/ax-llm vendors them for Qwen2.5-VL-3B (branch qwen2_5_vl_3b_video, commit 7112ffe,
scripts/qwen2_tokenizer/). The VL template is the one transformers 5 writes as
chat_template.jinja when it saves a Qwen2.5-VL-3B processor.
"""

from __future__ import annotations

import json

import pytest
from test_processor import (
    QWEN2_5_VL_3B,
    QWEN_IDS,
    images,
    qwen_config,
    user,
    write_qwen2_5_vl_3b_files,
)
from transformers.processing_utils import ProcessorMixin

from mlxc.runtime.checkpoint import processor as proc
from mlxc.runtime.checkpoint.tokenizer import ChatTemplateError, encode_prompt, load_tokenizer

TEXT_TEMPLATE = json.loads((QWEN2_5_VL_3B / "tokenizer_config.json").read_text())["chat_template"]
VL_TEMPLATE = json.loads((QWEN2_5_VL_3B / "chat_template.json").read_text())["chat_template"]
PAD = "<|image_pad|>"


@pytest.fixture
def hub_dir(tmp_path):
    """config.json + tokenizer + processor files laid out as Qwen2.5-VL-3B-Instruct's."""
    qwen_config("qwen2_5_vl").save_pretrained(tmp_path)
    write_qwen2_5_vl_3b_files(tmp_path)
    return tmp_path


def test_the_fixture_files_are_the_hub_ones():
    config = json.loads((QWEN2_5_VL_3B / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer" and config["eos_token"] == "<|im_end|>"
    assert config["model_max_length"] == 131072 and config["add_bos_token"] is False
    assert {"151652", "151655", "151653"} <= set(config["added_tokens_decoder"])
    # The tokenizer's template concatenates content as a string; the processor's loops parts.
    assert "message.content + '<|im_end|>'" in TEXT_TEMPLATE and "image" not in TEXT_TEMPLATE
    assert "<|vision_start|><|image_pad|><|vision_end|>" in VL_TEMPLATE


def test_an_image_prompt_renders_with_the_processor_template(hub_dir):
    tokenizer = load_tokenizer(hub_dir)
    assert tokenizer.chat_template == TEXT_TEMPLATE  # what AutoTokenizer reads
    processor = proc.load_processor(hub_dir, tokenizer, "qwen2_5_vit")
    assert processor.template_source == "chat_template.json"
    messages = user(1, "describe it")
    prompt = processor.encode(messages, images((50, 70)))  # was: TypeError

    text = tokenizer.apply_chat_template(
        messages, chat_template=VL_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"<|vision_start|>{PAD}<|vision_end|>describe it<|im_end|>\n<|im_start|>assistant\n"
    )
    n = int(prompt.vision["image_grid_thw"].prod()) // 4
    assert n > 1 and prompt.ids.count(QWEN_IDS["image_token_id"]) == n
    expanded = text.replace(PAD, PAD * n)
    assert prompt.ids == tokenizer.encode(expanded, add_special_tokens=False)
    # Text-only chats render with the same template.
    assert processor.encode([{"role": "user", "content": "hi"}]).ids == tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            chat_template=VL_TEMPLATE,
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )


@pytest.mark.parametrize("files", [(), ("json",), ("jinja",), ("json", "jinja")])
def test_vl_precedence_is_transformers(hub_dir, files):
    (hub_dir / "chat_template.json").unlink()
    if "json" in files:
        (hub_dir / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ 1 }}"}))
    if "jinja" in files:
        (hub_dir / "chat_template.jinja").write_text("JINJA {{ 2 }}")
    tokenizer = load_tokenizer(hub_dir)
    processor = proc.load_processor(hub_dir, tokenizer, "qwen2_5_vit")
    # transformers: the processor's template (json over jinja), else none (we fall back to the
    # tokenizer's, which transformers 5 itself reads from chat_template.jinja when there is one).
    theirs = ProcessorMixin.get_processor_dict(str(hub_dir), local_files_only=True)[0]
    want = theirs.get("chat_template") or tokenizer.chat_template
    assert (processor.chat_template or tokenizer.chat_template) == want
    source = {(): "tokenizer_config.json", ("jinja",): "chat_template.jinja"}
    assert processor.template_source == source.get(files, "chat_template.json")
    # The override wins over every file.
    override = proc.load_processor(hub_dir, tokenizer, "qwen2_5_vit", chat_template="O")
    assert (override.chat_template, override.template_source) == ("O", "--chat-template")


def test_a_text_model_keeps_the_tokenizer_template(hub_dir):
    # AutoTokenizer's choice; the processor file only fills in for a tokenizer without one.
    tokenizer = load_tokenizer(hub_dir)
    processor = proc.load_processor(hub_dir, tokenizer, None)
    assert processor.chat_template is None and processor.template_source == "tokenizer_config.json"
    tokenizer.chat_template = None
    processor = proc.load_processor(hub_dir, tokenizer, None)
    assert (processor.chat_template, processor.template_source) == (
        VL_TEMPLATE,
        "chat_template.json",
    )


def test_template_failures_are_value_errors_naming_the_template(hub_dir):
    tokenizer = load_tokenizer(hub_dir)
    # Only the tokenizer's text-only template left: images cannot render.
    (hub_dir / "chat_template.json").unlink()
    processor = proc.load_processor(hub_dir, tokenizer, "qwen2_5_vit")
    with pytest.raises(ChatTemplateError) as info:
        processor.encode(user(1), images((20, 20)))
    assert isinstance(info.value, ValueError) and str(info.value) == (
        "the chat template from tokenizer_config.json failed: "
        'TypeError: can only concatenate str (not "list") to str'
    )
    # raise_exception(...) in a template, from each source.
    raising = "{{ raise_exception('roles must alternate') }}"
    (hub_dir / "chat_template.json").write_text(json.dumps({"chat_template": raising}))
    for processor, source in (
        (proc.load_processor(hub_dir, tokenizer, "qwen2_5_vit"), "chat_template.json"),
        (proc.load_processor(hub_dir, tokenizer, None, chat_template=raising), "--chat-template"),
    ):
        with pytest.raises(ChatTemplateError, match=f"^the chat template from {source} failed: "):
            processor.encode_text_and_images("hi")
        with pytest.raises(ValueError, match="TemplateError: roles must alternate$"):
            processor.encode_text_and_images("hi")
    # encode_prompt (mlxc generate's text path) too.
    tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"
    with pytest.raises(ChatTemplateError, match="from tokenizer_config.json failed: TypeError"):
        encode_prompt(tokenizer, "hi")

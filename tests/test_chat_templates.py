"""/v1/chat/completions renders the model's own chat template (a directory's
tokenizer_config.json here; GGUF `tokenizer.chat_template` in test_openai_client, Gemma's
turn format in test_gemma3_270m) and stops at the stop tokens the model declares in
generation_config.json, as well as config.json's eos."""

from __future__ import annotations

import json
import os

import torch

from tests.helpers import make_random_llama, running_server

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime number."}]


def with_chat_template(path: str, template: str) -> None:
    """The directory's tokenizer_config.json carries `template`, and no chat_template.jinja
    (which transformers would prefer)."""
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(config_path, "w") as f:
        json.dump(config, f)
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)


def first_greedy_token(path: str, prompt_ids: list[int]) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return int(model(torch.tensor([prompt_ids])).logits[0, -1].argmax())


def test_chat_renders_the_directory_template_and_stops_at_generation_config_eos(tmp_path):
    from tokenizer_proc.tokenization import load_tokenizer

    path = make_random_llama(str(tmp_path / "model"), seed=5)
    with_chat_template(path, TEMPLATE)
    tokenizer = load_tokenizer(path)
    rendered = "[system] Be terse.\n[user] Name a prime number.\n[assistant]"
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == rendered
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    stop = first_greedy_token(path, prompt_ids)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [stop]}, f)

    with running_server(["--model", path, "--dtype", "float32"]) as server:
        res = server.client().chat.completions.create(model="model", messages=MESSAGES, max_tokens=8, temperature=0)
    assert res.usage.prompt_tokens == len(prompt_ids)
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens == 1, "the first token is the declared stop token"

"""Chat templates of six target families, written here from their documented behaviour (the model
cards and the templates' own comments: what a turn renders as, what the flags change, which earlier
content is dropped), reduced to what decides training: the tokens around each turn, the generation
prompt, the flags, the history rewriting. Not copies of the published files; each names its source.

Each runs on the byte-level tiny tokenizer (eagle3_train.targets.tiny) with the family's special
tokens added as special tokens, so end-of-turn tokens are single ids as in the real vocabularies.

``expected_reply(fixture, reasoning, answer, kwargs)`` is the reply a model of the family generates
after the request's generation prompt, written out by hand from the same documentation: the
independent reference the per-turn samples are compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3_train.targets.tiny import build_tiny_tokenizer


@dataclass
class Fixture:
    name: str
    family: str  # the tiny target family it runs on
    source: str  # what the template's behaviour was taken from
    template: str
    specials: list[str]
    eos: list[str]  # the end-of-turn tokens the model emits
    rewrites_history: bool  # drops or rewrites earlier assistant turns
    kwargs_variants: list[dict[str, Any]]  # the flag settings tested
    reply: Callable[[str | None, str, dict[str, Any]], str]  # (reasoning, answer, kwargs) -> generated text
    reasoning_field: str | None = "reasoning_content"  # where the fixture conversation keeps reasoning (None: inline)
    inline: str = "<think>\n{think}\n</think>\n\n{answer}"  # the content of a reply with its reasoning inline
    tokens: list[str] = field(default_factory=list)  # added tokens that are not special (Qwen3's <think>)
    markers: tuple[str, str] | None = ("<think>", "</think>")
    extra: dict[str, Any] = field(default_factory=dict)


QWEN3 = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def _qwen3_reply(reasoning: str | None, answer: str, kw: dict) -> str:
    if kw.get("enable_thinking") is False:  # the empty think block is the prompt's
        return answer + "<|im_end|>"
    return "<think>\n" + (reasoning or "") + "\n</think>\n\n" + answer + "<|im_end|>"


DEEPSEEK_R1 = (
    "{{- '<｜begin▁of▁sentence｜>' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜><think>\\n' -}}{%- endif -%}"
)


def _r1_reply(reasoning: str | None, answer: str, kw: dict) -> str:
    return (reasoning or "") + "\n</think>\n\n" + answer + "<｜end▁of▁sentence｜>"  # '<think>\n' is the prompt's


DEEPSEEK_V31 = (
    "{{- '<｜begin▁of▁sentence｜>' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- if '</think>' in content -%}{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}"
    "{{- '<｜Assistant｜></think>' + content + '<｜end▁of▁sentence｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}"
    "{%- if thinking is defined and thinking -%}{{- '<think>' -}}{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def _v31_reply(reasoning: str | None, answer: str, kw: dict) -> str:
    if kw.get("thinking"):
        return (reasoning or "") + "</think>" + answer + "<｜end▁of▁sentence｜>"  # '<think>' is the prompt's
    return answer + "<｜end▁of▁sentence｜>"


GPT_OSS = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{{- '<|start|>system<|message|>You are ChatGPT.\\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\\n# Valid channels: analysis, final.<|end|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|start|>developer<|message|># Instructions\\n' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'user' -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if m.thinking is defined and m.thinking and loop.index0 > ns.last_user -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content -}}"
    "{%- if loop.last and not add_generation_prompt -%}{{- '<|return|>' -}}{%- else -%}{{- '<|end|>' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def _oss_reply(reasoning: str | None, answer: str, kw: dict) -> str:
    analysis = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else ""
    return analysis + "<|channel|>final<|message|>" + answer + "<|return|>"


LLAMA31 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if messages[0].role == 'system' -%}{%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' -}}"
    "{%- for m in rest -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


def _llama_reply(reasoning: str | None, answer: str, kw: dict) -> str:
    return answer + "<|eot_id|>"


KIMI_K2_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if messages[0].role != 'system' -%}{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|im_system|>system<|im_middle|>' + m.content + '<|im_end|>' -}}"
    "{%- elif m.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' -}}"
    "{%- elif m.role == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<think>' + (m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '') + '</think>' -}}"
    "{%- else -%}{{- '<think></think>' -}}{%- endif -%}"
    "{{- m.content + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)


def _kimi_reply(reasoning: str | None, answer: str, kw: dict) -> str:
    return "<think>" + (reasoning or "") + "</think>" + answer + "<|im_end|>"


FIXTURES = {
    f.name: f
    for f in (
        Fixture(
            "qwen3",
            "qwen3",
            "Qwen3 model card (thinking / non-thinking modes, enable_thinking) and its chat template's behaviour: "
            "reasoning of turns before the last user message dropped, the last turn's kept in <think>",
            QWEN3,
            [],
            ["<|im_end|>"],
            True,
            [{}, {"enable_thinking": True}, {"enable_thinking": False}],
            _qwen3_reply,
            tokens=["<think>", "</think>"],
        ),
        Fixture(
            "deepseek_r1",
            "deepseek_v3",
            "DeepSeek-R1 model card (the template opens <think>\\n in the generation prompt; earlier replies "
            "rendered without their reasoning, split at </think>)",
            DEEPSEEK_R1,
            ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
            ["<｜end▁of▁sentence｜>"],
            True,
            [{}],
            _r1_reply,
            reasoning_field=None,
        ),
        Fixture(
            "deepseek_v3_1",
            "deepseek_v3",
            "DeepSeek-V3.1 model card (thinking=True opens <think>, non-thinking closes </think> in the "
            "generation prompt; history replies as </think>answer)",
            DEEPSEEK_V31,
            ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
            ["<｜end▁of▁sentence｜>"],
            True,
            [{"thinking": True}, {"thinking": False}],
            _v31_reply,
            reasoning_field=None,
            inline="<think>{think}</think>{answer}",
        ),
        Fixture(
            "gpt_oss",
            "gpt_oss",
            "OpenAI harmony response format (system reasoning_effort, analysis and final channels, <|return|> "
            "ending the last message, earlier analysis dropped once a final answer followed)",
            GPT_OSS,
            ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"],
            ["<|return|>"],
            True,
            [{"reasoning_effort": "low"}, {"reasoning_effort": "high"}],
            _oss_reply,
            reasoning_field="thinking",
            markers=("<|channel|>analysis", "<|end|>"),
        ),
        Fixture(
            "llama3_1",
            "llama",
            "Llama 3.1 prompt format (system header with knowledge and today dates, <|eot_id|> ending each turn)",
            LLAMA31,
            [],
            ["<|eot_id|>"],
            False,
            [{}],
            _llama_reply,
            reasoning_field=None,
            markers=None,
        ),
        Fixture(
            "kimi_k2_thinking",
            "deepseek_v3",
            "Kimi-K2-Thinking model card (reasoning_content of the current turn in <think>, earlier turns "
            "rendered with an empty <think></think>)",
            KIMI_K2_THINKING,
            ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
            ["<|im_end|>"],
            True,
            [{}],
            _kimi_reply,
            tokens=["<think>", "</think>"],
        ),
    )
}


def fixture_tokenizer(f: Fixture) -> Any:
    """The tiny byte-level tokenizer with ``f``'s template and its special tokens."""
    tok = build_tiny_tokenizer(f.template)
    if f.specials:
        tok.add_special_tokens({"additional_special_tokens": list(f.specials)}, replace_extra_special_tokens=False)
    if f.tokens:
        tok.add_tokens(list(f.tokens))
    return tok


def conversation(f: Fixture, reasoning: bool = True) -> dict[str, Any]:
    """A two-turn conversation with reasoning in both replies, in the form ``f`` keeps it."""
    turns = [("What is 2+3?", "Add two and three.", "It is 5."), ("And times 4?", "Five times four.", "It is 20.")]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for user, think, answer in turns:
        messages.append({"role": "user", "content": user})
        if not reasoning:
            messages.append({"role": "assistant", "content": answer})
        elif f.reasoning_field is None:
            messages.append({"role": "assistant", "content": f.inline.format(think=think, answer=answer)})
        else:
            messages.append({"role": "assistant", "content": answer, f.reasoning_field: think})
    return {"messages": messages}

"""The model card ``eagle3-export`` writes beside the weights (``README.md``): what the draft is for
and how to serve it, ready to publish on the Hugging Face hub.

The card opens with the hub's YAML front matter (``base_model``, ``library_name``, ``license``,
``tags``), then says which target the draft was trained for (name, ``model_type``, the identity
hashes), which capture (HF indices, docs/concepts/hf-index.md, and the ids each engine reads from
``config.json``), the exact serve command of each engine (built by the engine's module, the one
source of its command line), and, when an ``eagle3-eval`` report of these very files lies beside
the export (eval's default ``<export>-eval-<engine>``), its τ table.

Nothing on the card names a local path: the target by its hub id or directory name, the draft by
its hub id or directory name, prompt files by file name.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.reports import EvalReport, read_eval_report
from eagle3_train.engines import registry
from eagle3_train.engines.base import named_dtype
from eagle3_train.engines.rules import resolve

CARD_NAME = "README.md"
LIBRARY_NAME = "eagle3_train"
DEFAULT_K = 5  # draft tokens per step when the checkpoint does not record its TTT steps (eval's default k)


def eval_dir(draft: Path, engine: str) -> Path:
    """Where ``eagle3-eval`` writes its report by default: beside the draft, never inside it."""
    return draft.with_name(f"{draft.name}-eval-{engine}")


def public_name(name: str) -> str:
    """How a target or draft is named outside this machine: a hub id (``org/model``) or a name
    (``embedded``, ``tiny:llama``) as it is, a local path by its last component."""
    path = Path(name).expanduser()
    local = name.startswith(("/", "~", ".")) or path.exists() or name.count("/") > 1
    return path.name if local else name


def eval_reports(export: Path, files: dict[str, str]) -> list[EvalReport]:
    """The finished ``eagle3-eval`` reports beside ``export`` (eval's default directories) whose
    draft was exactly ``files`` ({file name: sha256}, as eval records them), by engine."""
    found = []
    for path in sorted(export.parent.glob(f"{export.name}-eval-*/report.json")):
        try:
            report = read_eval_report(path)
        except BadInputError:
            continue  # an unreadable report (or another version's) describes nothing here
        if report.record.get("stage") == "eval" and (report.record.get("request") or {}).get("draft") == files:
            found.append(report)
    return found


def front_matter(base_model: str, license: str, engines: list[str]) -> dict[str, Any]:
    """The hub's YAML metadata of the card."""
    return {
        "base_model": base_model,
        "library_name": LIBRARY_NAME,
        "license": license,
        "tags": ["eagle3", "speculative-decoding", "draft-model", *engines],
    }


def yaml_block(meta: dict[str, Any]) -> str:
    """``meta`` (strings, and lists of strings) as a YAML block; each string JSON-quoted, which YAML
    reads as the same string."""
    lines = []
    for key, value in meta.items():
        items = value if isinstance(value, list) else None
        lines += (
            [f"{key}:", *(f"- {json.dumps(v)}" for v in items)]
            if items is not None
            else [f"{key}: {json.dumps(value)}"]
        )
    return "\n".join(lines) + "\n"


def serve_commands(engines: list[str], base_model: str, draft: str, k: int, dtype: str | None = None) -> dict[str, str]:
    """{engine: the shell command that serves ``base_model`` with ``draft``, ``k`` tokens a step},
    each built by its engine module; an engine that runs a draft in its own config's dtype
    (``draft_dtype_own``) is told the draft's ``dtype`` for both models, so the command serves a
    target whose config names another dtype too."""
    return {
        e: shlex.join(
            registry.ENGINES[e].serve_command(
                base_model, draft, k, **({"dtype": dtype} if dtype and registry.ENGINES[e].draft_dtype_own else {})
            )
        )
        for e in engines
        if registry.ENGINES[e].serve is not None
    }


def model_card(
    config: dict[str, Any],
    engines: list[str],
    base_model: str,
    repo_id: str | None,
    directory: str,
    license: str,
    reports: list[EvalReport],
) -> str:
    """The card's text for an export whose ``config.json`` is ``config``, made for ``engines``.

    Args:
        config: the exported config.json (its ``eagle3_train`` block says target, capture, training).
        engines: the engines the config was written for.
        base_model: the target's hub id (or name).
        repo_id: the draft's hub id, by which the serve commands name it (None: by ``directory``).
        directory: the export directory's name.
        license: the card's license field.
        reports: eval reports of these files (:func:`eval_reports`).
    """
    meta = config["eagle3_train"]
    training = meta.get("training") or {}
    k = int(training.get("ttt_length") or DEFAULT_K)
    head = "---\n" + yaml_block(front_matter(base_model, license, engines)) + "---\n\n"
    lines = [
        *_about(config, base_model, training),
        *_target_section(meta["target"], meta["capture"]),
        *_capture_section(config, engines, meta["target"]["model_type"], meta["capture"]),
        *_serve_section(config, engines, base_model, repo_id, directory, k),
        *_evaluation_section(reports),
        *_training_section(meta, training),
    ]
    return head + "\n".join(lines) + "\n"


def _about(config: dict[str, Any], base_model: str, training: dict[str, Any]) -> list[str]:
    """The title and what the draft is: its shapes, and the checkpoint it was exported from."""
    return [
        f"# EAGLE-3 draft for {base_model}",
        "",
        f"A one-layer EAGLE-3 draft head (`LlamaForCausalLMEagle3`: hidden size {config['hidden_size']}, draft vocab "
        f"{config['draft_vocab_size']} of {config['vocab_size']}) that proposes tokens for `{base_model}` to verify, "
        f"trained with {LIBRARY_NAME} (checkpoint `{training.get('checkpoint')}`, step {training.get('step')}"
        f"{', the best by eval tau' if training.get('is_best') else ''}; {training.get('ttt_length')} training-time "
        f"test steps).",
        "",
    ]


def _target_section(target: dict[str, Any], capture: dict[str, Any]) -> list[str]:
    """The target the draft fits, by name and hashes, and the chat template flags it was trained with."""
    lines = [
        "## Target",
        "",
        "| name | model_type | layers N | hidden size | vocab | config sha256 | tokenizer sha256 | chat template sha256 |",
        "|---|---|---|---|---|---|---|---|",
        f"| `{public_name(target['path'])}` | `{target['model_type']}` | {capture['num_hidden_layers']} | "
        f"{capture['hidden_size']} | {capture['vocab_size']} | `{target['config_hash']}` | `{target['tokenizer_hash']}` | "
        f"`{target['chat_template_hash']}` |",
        "",
        "The draft only fits this target: another model (or a target whose config hash differs, beyond a quantized or "
        "re-saved copy of it) feeds it states it never saw. `eagle3-check draft=<this directory> target=<target>` "
        "compares them.",
        "",
    ]
    if target.get("chat_template_kwargs"):
        lines += [
            f"The training conversations were rendered with `chat_template_kwargs` "
            f"`{json.dumps(target['chat_template_kwargs'], sort_keys=True)}`: send requests with the same "
            f'(`extra_body={{"chat_template_kwargs": ...}}`); other flags change the contexts the draft sees.',
            "",
        ]
    return lines


def _capture_section(config: dict[str, Any], engines: list[str], model_type: str, capture: dict[str, Any]) -> list[str]:
    """The HF indices trained on, and what each engine reads from config.json and captures from it."""
    lines = [
        "## Capture",
        "",
        f"Trained on the target's hidden states at HF indices `{capture['aux_indices']}` (transformers' "
        f"`hidden_states[k]`: 0 is the embeddings, k the output of decoder layer k), {capture['dtype']}. What each "
        f"engine reads from `config.json` and captures from it:",
        "",
        "| engine | reads | ids | captures |",
        "|---|---|---|---|",
    ]
    for e in engines:
        engine = registry.ENGINES[e]
        for r in resolve(config, e, model_type, capture["num_hidden_layers"])[:1]:  # the engine's default runner
            lines.append(f"| {engine.title} {r.rule.versions} | `{r.source}` | `{r.ids}` | {r.describe()} |")
    return lines


def _serve_section(
    config: dict[str, Any], engines: list[str], base_model: str, repo_id: str | None, directory: str, k: int
) -> list[str]:
    """Each engine's serve command, drafting ``k`` tokens a step, the draft named by hub id or directory."""
    where = (
        f"the draft from the hub as `{repo_id}`"
        if repo_id
        else f"the draft from the directory `{directory}` (run them beside it, or name the draft by its hub id once "
        f"published)"
    )
    lines = ["", "## Serve", "", f"Drafting {k} tokens per step (the steps it was trained for), {where}:", ""]
    for e, command in serve_commands(engines, base_model, repo_id or directory, k, named_dtype(config)).items():
        lines += [f"{registry.ENGINES[e].title}:", "", "```bash", command, "```", ""]
    return lines


def _evaluation_section(reports: list[EvalReport]) -> list[str]:
    """The τ table of the eval reports of these files, or how to make one."""
    return ["## Evaluation", ""] + (
        _tau_table(reports)
        if reports
        else [
            "No `eagle3-eval` report of these files lay beside this directory when it was exported. `eagle3-eval "
            "draft=<this directory> target=<target> engine=<engine> prompts=<file>` writes one beside it; exporting again "
            "adds its table here.",
            "",
        ]
    )


def _training_section(meta: dict[str, Any], training: dict[str, Any]) -> list[str]:
    """The rules and vocab map versions, and the checkpoint's own held-out evaluation if it had one."""
    own = training.get("eval") or {}
    lines = [
        "## Training",
        "",
        f"Engine rules version `{meta.get('rules_version')}`; vocab map sha256 `{meta.get('vocab_map_sha256')}`.",
    ]
    if own.get("eval_acc") is not None:
        lines[-1] += (
            " The checkpoint's own evaluation on the run's held-out split: teacher-forced accuracy per draft "
            f"position {[round(a, 3) for a in own['eval_acc']]}, simulated τ {own.get('eval_tau', 0):.2f}."
        )
    return lines


def _tau_table(reports: list[EvalReport]) -> list[str]:
    """τ (tokens per verify step) and acceptance per draft position of each eval report, with
    each category's τ when a prompt file has several."""
    rows = [
        "`eagle3-eval` (greedy chain speculative decoding with the target in transformers, fed the layers the "
        "engine's rule reads; τ counts the target's own token of each step):",
        "",
        "| engine | prompts | turns | k | τ | acceptance per position | lossless | dtype |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        prompts = public_name(str(r.config.get("prompts", "")))
        accept = ", ".join(f"{a:.2f}" for a in r.acceptance_per_position)
        rows.append(
            f"| {r.engine} | `{prompts}` | {r.prompts} | {r.k} | {r.tau:.2f} | {accept} | {r.lossless} | {r.dtype} |"
        )
        if len(r.categories) > 1:
            for cat, v in r.categories.items():
                accept = ", ".join(f"{a:.2f}" for a in v["acceptance_per_position"])
                rows.append(
                    f"| {r.engine} | `{prompts}`: {cat} | {v['prompts']} | {r.k} | {v['tau']:.2f} | {accept} | | |"
                )
    return rows + [""]

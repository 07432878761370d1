"""The run's inputs, checked before any process group exists: the reward functions (every rank:
an import and a signature each) and, on global rank 0, the data: every held-out set loaded, the
training prompts tokenized into the run's prompt file, and every ``reward.by_source``
key matched to a source. A bad row, message, field or route is an error naming the file, row and
field or key, in seconds, with nothing written (``prompt_store.write_prompt_file`` removes what
it made), instead of after megatron's groups, the model and the engines were built.

The prompt file is written beside the run directory, not in it (``prompt_store.staging_dir``):
until every rank agreed that it sees the directory rank 0 sees (``run_dir.agree``), nothing goes
into it, so another rank's ``run_dir.check`` never finds rank 0's half-made files, and a start
that stops there leaves nothing (``prompt_store.discard_staging``). The other ranks do not wait
for this before they start their default group: they wait in its first collective
(``run_dir.agree``), for as long as ``parallel.timeout_minutes`` allows (rank 0 tokenizes ~10^4
prompts a second: 10^6 in ~2 minutes); if rank 0 stops here, torchrun stops them. Once the
groups exist, ``prompt_store.open_prompt_set`` moves the file in (a rename) and every rank
opens it.
"""

from __future__ import annotations

from pathlib import Path

from mugrpo_megatron.config import Config


def check_rewards(cfg: Config) -> None:
    """Every reward function the run may call imports and takes what the scorer gives
    (``rewards.reward_specs``); ValueError naming the setting otherwise. Every rank."""
    from mugrpo_megatron.rewards import reward_specs

    reward_specs(cfg.reward)


def load_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.path,
                                         trust_remote_code=cfg.model.trust_remote_code)


def prepare_data(cfg: Config, start: str, tokenizer=None, note=lambda _: None, bar=None
                 ) -> list[Path]:
    """Global rank 0, before any process group: load every held-out set (the trainer loads them
    again on every rank: a few thousand prompts); tokenize the training prompts into the staging
    directory beside the run directory (``prompt_store.staging_dir``; ``open_prompt_set`` moves
    the file in once every rank agreed on the run directory) unless the run directory (for a
    start that keeps it) or the staging directory holds it complete. Returns the directories it
    made, deepest first, for ``prompt_store.discard_staging`` if the start goes no further.
    ValueError for bad data, nothing written."""
    from mugrpo_megatron.data import load_eval_sets
    from mugrpo_megatron.data.prompt_store import (
        prompt_key,
        prompt_paths,
        staging_dir,
        write_prompt_file,
    )

    tokenizer = tokenizer or load_tokenizer(cfg)
    sets = load_eval_sets(cfg.data, tokenizer)
    key, directory = prompt_key(cfg), Path(cfg.logging.run_dir)
    if start != "replace" and prompt_paths(directory, key)[1].is_file():
        note(f"prompts: reusing {prompt_paths(directory, key)[0]}")
        return []
    path, done = prompt_paths(staging_dir(directory), key)
    if done.is_file():
        note(f"prompts: reusing {path}")
        return []
    made = [d for d in (path.parent, *path.parents) if not d.exists()]
    write_prompt_file(cfg, tokenizer, path, done, bar,
                      other_sources=sorted({p.source for prompts, _ in sets.values()
                                            for p in prompts}))
    return made

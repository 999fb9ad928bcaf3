"""One vocabulary for the options that recipes, trainer keywords and command lines share.

Each shared option has one name: the recipe key's leaf (``parallel.cp_size`` -> ``cp_size``), which
is also the :class:`~ringft.train.hf.RingTrainerMixin` keyword, the parsed ``argparse`` dest and
the TRL scripts' dataclass field. Its command-line flag is the name with dashes (``--cp-size``;
``--cp_size`` is accepted too), its help text and type come from :data:`OPTIONS`. Every command
adds these flags with :func:`add_option` (or :func:`option_field` for a ``TrlParser`` dataclass).

Older spellings stay accepted: an old flag (``--cp``) prints once, on stderr and on rank 0 only,
"`--cp` is now `--cp-size`", then behaves exactly as the new one; the new and an old spelling on
one command line is an error. An old trainer keyword (``ring_backend=``) warns once
(``FutureWarning``); both the new and the old keyword is a ``ValueError``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ringft.utils.values import tokens_arg

__all__ = [
    "OPTIONS",
    "SharedOption",
    "add_flag",
    "add_option",
    "note_renamed",
    "option_field",
    "renamed_keyword",
]


@dataclass(frozen=True)
class SharedOption:
    """One option as every interface spells it."""

    name: str  # the recipe key's leaf = trainer keyword = argparse dest = TRL dataclass field
    recipe_key: str
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    old_flags: tuple[str, ...] = ()  # earlier command-line spellings, still accepted with a note
    old_keywords: tuple[str, ...] = ()  # earlier trainer keywords, still accepted with a FutureWarning

    @property
    def flag(self) -> str:
        """The command-line flag: ``--cp-size``."""
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        """Every current spelling: ``("--cp-size", "--cp_size")``."""
        under = "--" + self.name
        return (self.flag,) if under == self.flag else (self.flag, under)


_TOKENS = "; a count of tokens (65536, 64k)"

OPTIONS: dict[str, SharedOption] = {
    o.name: o
    for o in (
        SharedOption(
            "attn_backend",
            "model.attn_backend",
            "the attention block kernel: auto (cudnn on Hopper, else flash_attn when installed, else "
            "cudnn, else torch), torch, flash_attn, cudnn or reference",
            choices=("auto", "torch", "flash_attn", "cudnn", "reference"),  # = ringft.ops.BACKENDS
            old_flags=("--backend", "--ring-backend", "--ring_backend"),
            old_keywords=("ring_backend",),
        ),
        SharedOption(
            "cp_size",
            "parallel.cp_size",
            "ranks per context-parallel group (the ring; dp = processes / cp_size)",
            type=int,
            old_flags=("--cp",),
        ),
        SharedOption(
            "ulysses_size",
            "parallel.ulysses_size",
            "CP = Ulysses x ring: ranks per Ulysses head all-to-all (1: the zigzag ring alone)",
            type=int,
        ),
        SharedOption(
            "tiled_mlp_tokens",
            "train.tiled_mlp_tokens",
            "run the MLP over tiles of this many tokens" + _TOKENS,
            type=tokens_arg,
        ),
        SharedOption(
            "tiled_norm_tokens",
            "train.tiled_norm_tokens",
            "run the RMSNorms over tiles of this many tokens (not under DeepSpeed)" + _TOKENS,
            type=tokens_arg,
        ),
        SharedOption(
            "attention_tile_tokens",
            "train.attention_tile_tokens",
            "run the attention kernels over tiles of at most this many queries and keys" + _TOKENS,
            type=tokens_arg,
        ),
        SharedOption(
            "loss_chunk_size",
            "train.loss_chunk_size",
            "tokens per chunk of the lm_head + cross-entropy (no full logits)" + _TOKENS,
            type=tokens_arg,
        ),
        SharedOption(
            "attention_checkpoint",
            "train.attention_checkpoint",
            "under gradient checkpointing: recompute the attention forward in the backward, save its "
            "output + lse on the GPU, or offload them to host memory",
            choices=("recompute", "save", "offload"),
        ),
    )
}

_NOTED: set[str] = set()


def note_renamed(old: str, new: str) -> None:
    """Print "`old` is now `new`" on stderr, once per process and only on rank 0 (``RANK``)."""
    if old in _NOTED or os.environ.get("RANK", "0") != "0":
        return
    _NOTED.add(old)
    print(f"ringft: note: `{old}` is now `{new}` (the old name still works)", file=sys.stderr)


class _Spelled(argparse.Action):
    """Store (or, ``append=True``, append) the value; an old spelling notes the new one once; the new
    and an old spelling on one command line is a parser error."""

    def __init__(self, option_strings, dest, *, old: Sequence[str] = (), append: bool = False, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.old, self.append = tuple(old), append
        self._namespace: Any = None
        self._used: dict[bool, str] = {}  # is it an old spelling -> the spelling used

    def __call__(self, parser, namespace, values, option_string=None):
        if namespace is not self._namespace:  # a new command line
            self._namespace, self._used = namespace, {}
        is_old = option_string in self.old
        self._used[is_old] = option_string
        new = self.option_strings[0]
        if len(self._used) == 2:
            parser.error(
                f"{self._used[False]} given together with its old name {self._used[True]}: give {new} only"
            )
        if is_old:
            note_renamed(option_string, new)
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def add_flag(
    parser: argparse.ArgumentParser | Any,
    *flags: str,
    old: Sequence[str] = (),
    append: bool = False,
    **kwargs,
) -> argparse.Action:
    """``parser.add_argument(*flags, *old, ...)``, the old spellings noted once when used."""
    return parser.add_argument(*flags, *old, action=_Spelled, old=tuple(old), append=append, **kwargs)


def add_option(
    parser: argparse.ArgumentParser | Any,
    name: str,
    *,
    note: str | None = None,
    append: bool = False,
    **kwargs: Any,
) -> argparse.Action:
    """Add the shared option ``name`` of :data:`OPTIONS`: its flags and old spellings, dest, type,
    choices and help (``note``: what this command adds to the help). ``kwargs``: ``default``,
    ``required``, ``metavar`` (or a ``type`` / ``choices`` that narrows the table's)."""
    o = OPTIONS[name]
    settings: dict[str, Any] = {"type": o.type, "dest": o.name, "metavar": o.name.upper()}
    settings.update({"choices": o.choices} if o.choices else {}, **kwargs)
    text = f"{o.help} (recipe {o.recipe_key})" + (f"; {note}" if note else "")
    return add_flag(parser, *o.flags, old=o.old_flags, append=append, help=text, **settings)


def option_field(name: str, default: Any) -> Any:
    """A ``dataclasses.field`` for a ``TrlParser`` / ``HfArgumentParser`` dataclass: the option's help,
    its choices, and its old flags (noted once when used) as aliases."""
    o = OPTIONS[name]
    # HfArgumentParser types the field by its annotation (an int): no "64k" spelling there
    text = o.help.replace(_TOKENS, "; a count of tokens")
    meta: dict[str, Any] = {"help": f"{text} (recipe {o.recipe_key})"}
    if o.old_flags:
        meta.update(aliases=list(o.old_flags), action=_Spelled, old=o.old_flags)
    if o.choices:
        meta["choices"] = o.choices
    return dataclasses.field(default=default, metadata=meta)


def renamed_keyword(where: str, kwargs: dict[str, Any], name: str, value: Any, default: Any) -> Any:
    """The value of keyword ``name`` (``value``; None when not given), taking an old keyword of the
    option from ``kwargs`` (removed there; a ``FutureWarning`` once); both given: ``ValueError``."""
    for old in OPTIONS[name].old_keywords:
        if old not in kwargs:
            continue
        if value is not None:
            raise ValueError(f"{where}: {name}= and its old name {old}= both given: pass {name}= only")
        value = kwargs.pop(old)
        if old not in _NOTED:
            _NOTED.add(old)
            warnings.warn(f"{where}: `{old}=` is now `{name}=`", FutureWarning, stacklevel=3)
    return default if value is None else value

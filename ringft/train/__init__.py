"""Training: the recipe schema and ``ringft train``, a recipe front end over ``transformers.Trainer``
with :class:`ringft.train.hf.RingTrainerMixin` (CP x DP under Accelerate, DeepSpeed or FSDP).

Modules, one job each: ``recipe`` (typed schema) and ``fields`` (its checks), ``build`` (tokenizer,
model config, model, optimizer groups), ``data`` (loading, checks, data order), ``front`` (recipe ->
``TrainingArguments`` + trainer; :func:`train`), ``front_parts`` (dataset, sampler, collator, metrics
callback), ``front_runs`` (the run folder: lock, checkpoint choice, export), ``front_launch``
(DeepSpeed / precision settings), ``schedule``, ``errors``, ``hf/`` (the mixin). The former own loop
(``loop``, ``integrations``, ``master_weights``, ``checkpoint``, ``run_dir``) runs with
``ringft train --engine loop`` until its removal.
"""

from ringft.train.errors import RecipeError, TrainError
from ringft.train.front import train
from ringft.train.loop import Trainer
from ringft.train.recipe import Recipe, load_recipe, recipe_from_dict
from ringft.train.schedule import TrainResult

__all__ = [
    "Recipe",
    "RecipeError",
    "TrainError",
    "TrainResult",
    "Trainer",
    "load_recipe",
    "recipe_from_dict",
    "train",
]

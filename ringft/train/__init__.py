"""Training: the recipe schema and ``ringft train``, a recipe front end over ``transformers.Trainer``
with :class:`ringft.train.hf.RingTrainerMixin` (CP x DP under Accelerate, DeepSpeed or FSDP: the
Trainer and accelerate handle the distributed setup, ringft the ring, the loss and the run folder).

Modules, one job each: ``recipe`` (typed schema) and ``fields`` (its checks), ``overrides``
(command-line keys), ``build`` (tokenizer, model config, model, LoRA, decayed parameters), ``data``
(loading, checks, eval split, epoch order), ``front`` (recipe -> ``TrainingArguments`` + trainer;
:func:`train`), ``front_parts`` (dataset, sampler, collator, metrics callback), ``front_runs`` (the
run folder: checkpoint choice and completion, recipe comparison on resume, export), ``run_folder``
(its lock and ``metrics.jsonl``), ``front_launch`` (DeepSpeed / precision settings of the launch),
``schedule``, ``errors``, ``hf/`` (the mixin and its TRL trainers).
"""

from ringft.train.errors import RecipeError, TrainError
from ringft.train.front import train
from ringft.train.recipe import Recipe, load_recipe, recipe_from_dict
from ringft.train.schedule import TrainResult

__all__ = [
    "Recipe",
    "RecipeError",
    "TrainError",
    "TrainResult",
    "load_recipe",
    "recipe_from_dict",
    "train",
]

"""Training: the recipe schema and the Accelerate loop combining CP with DP.

Modules, one job each: ``recipe`` (typed schema) and ``fields`` (its checks), ``build`` (tokenizer,
model config, model, optimizer groups), ``data`` (loading, checks, data order), ``integrations``
(DDP / DeepSpeed / FSDP specifics), ``master_weights`` (fp32 masters under DDP), ``checkpoint``
(save, resume, export), ``run_dir`` (lock, metrics.jsonl), ``loop`` (the Trainer), ``errors``.
"""

from ringft.train.errors import RecipeError, TrainError
from ringft.train.loop import Trainer, train
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

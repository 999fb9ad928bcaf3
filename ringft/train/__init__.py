"""Training: the recipe schema and the Accelerate loop combining CP with DP."""

from ringft.train.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict
from ringft.train.trainer import Trainer, TrainResult, train

__all__ = ["Recipe", "RecipeError", "TrainResult", "Trainer", "load_recipe", "recipe_from_dict", "train"]

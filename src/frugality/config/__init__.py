"""Recipes: TOML files validated into typed objects before anything runs."""

from frugality.config.recipe import Recipe, load_recipe, shipped_recipes

__all__ = ["Recipe", "load_recipe", "shipped_recipes"]

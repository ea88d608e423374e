"""Prompt formats written in Python, for checkpoints that ship no Jinja chat template."""

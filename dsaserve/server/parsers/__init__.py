"""Output parsers: GLM reasoning (`glm45`) and tool calls (`glm47`, `glm45`)."""

"""`dspark train`: self-distillation data, target features, the DeepSpec objective, the loop, export.

Stages (each resumable, each a module): data -> features -> trainer (loss, evaluate) -> export.
"""

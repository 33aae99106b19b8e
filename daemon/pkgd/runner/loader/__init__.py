"""Loading weights into a model: safetensors from a resolved `pkgd.model_files.ModelFiles`
directory (`weights`), and the compute dtype (`dtype`). Both need torch and run only in
engine processes.
"""

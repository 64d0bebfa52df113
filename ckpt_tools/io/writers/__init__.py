"""The writer layer: each writer executes a plan of copied spans and streamed producers into one
output (torch zip, safetensors, a Hugging Face folder).
"""

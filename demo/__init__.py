"""Gradio multi-turn chat demo of stateful-hf: `python -m demo --help`."""

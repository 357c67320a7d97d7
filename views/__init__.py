"""Gradio playground views: one module per tab, plus pure figure builders (figures*.py)."""

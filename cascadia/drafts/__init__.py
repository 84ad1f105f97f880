"""Captured-state draft evaluation (`cascadia draft-eval`): the deployed path's final hidden states, captured while it
generates, fed to cheaper draft heads to measure how often and how far their drafts would be accepted."""

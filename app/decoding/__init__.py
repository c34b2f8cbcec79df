"""Per-token decisions: stop checks, sampling and drafts, the tokens a pass adds, the guide's grammar and its matcher.
Its face is empty: nothing here is the page's."""

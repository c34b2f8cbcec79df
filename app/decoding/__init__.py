"""Per-token decisions: stop checks, sampling and drafts, the tokens a pass adds, the guide's grammar and its matcher.
The stop records themselves (Stop, StopReason, Limit) are app.episode's. Nothing here is the page's: its face is
empty."""

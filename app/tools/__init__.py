"""Tools the model can call. Standard library only (no torch or transformers under app/tools), so the calculator can be
imported from a separate environment."""

from app.tools.base import Tool, ToolError, ToolResult
from app.tools.registry import default_tools, find_tool, get_tools, run_tool

__all__ = ["Tool", "ToolError", "ToolResult", "default_tools", "find_tool", "get_tools", "run_tool"]

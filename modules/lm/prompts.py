"""System prompts of the paper's games (App. E.4), shared by the families and the data that warm-starts them."""

from __future__ import annotations

#: the leader's system message (Qwen2.5-Instruct's own default)
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
#: the follower's system message; ``{leader_response}`` is replaced by the leader's reply
FOLLOWER_SYSTEM = (
    QWEN_SYSTEM + " Another assistant previously answered the user's request as follows:\n{leader_response}\n"
    "Write a different, higher-quality answer to the user's request. Respond directly to the user as if answering "
    "for the first time. Do not mention, quote, or reference the previous answer."
)

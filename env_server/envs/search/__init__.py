"""The search family: multi-hop question answering with a real retriever (AgentGym-RL's SearchQA)."""

"""The computations a stage calls: the policy and reward at hand (workspace), sampling, scoring,
training and the update's body. May import the contracts, models (policy, rewards), prompts,
runtime, reporting, storage and stepgrpo_core; never a task or a flow."""

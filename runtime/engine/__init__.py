"""The engine: requests, scheduler (step plans), model runner, sampler, and the loop that ties them."""

"""What a workload is made of, shared by `pdserve bench` and the planner: token
lengths (`lengths`), arrival times (`arrivals`), the named length profiles and the
one function that draws a profile's lengths for a seed (`profiles`), and the JSONL
trace row (`trace`). Imports nothing from `pdserve.bench` or `pdserve.planner`.
"""

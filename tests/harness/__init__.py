"""What the tests run on, imported as `tests.harness.<module>` (conftest.py puts the repo root on
sys.path; servers load the fake workers by that name too, e.g. `tests.harness.slow_worker`).

Processes: `cluster` (real servers), `fault_tools` (knob servers, a router, clients, the fault
suites' request and fault windows), `procs` (/proc probes), `shared_servers` (servers lent
across e2e modules), `netns` (hosts in network namespaces), `stub_pd_server` /
`stub_openai_server` / `fault_stubs` (peers that misbehave on demand); each process is a
core/launcher.ProcessGroup. Fakes that import the code they stand in for: `fake_engine` (the
real page allocator and step types over a numpy pool), `fake_worker` and `scripted_worker` (the
real worker loop and colocated role over a fake engine), `slow_worker` (the real worker, slowed
on demand). In-process rigs: `handoff_harness`, `transfer_pools` (pools and pairs of started
transfer backends), `front_fakes` (a recording pool and tokenizer under a front's request path).
Shared checks: `pd_answers` (the PD e2e modules' prompts, colocated reference and backend
scenarios). Models: `tiny_model`, `tiny_families`, `bf16_rounding`. The one TCP proxy is
pdserve/bench/tcp_proxy.py (the chaos bench uses it too).
"""

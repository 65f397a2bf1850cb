"""The `twinfer` console script: options declared here, implementations imported inside each command,
so `--help` and `plan` never load torch or mlx. A `TwinferError` prints as one line, non-zero exit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from twinfer.runtime.errors import TwinferError

app = typer.Typer(
    name="twinfer",
    help="One LLM inference runtime, two targets: fit a model on a laptop, make it fast on a GPU server.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
eval_app = typer.Typer(help="Judge a model or a runner against a reference.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")

ModelArg = Annotated[
    Optional[str],  # noqa: UP045 - typer reads the annotation at run time
    typer.Argument(help="GGUF file or Hugging Face model folder. Default: the embedded Gemma 3 270M Q4_K_M."),
]
BackendOpt = Annotated[
    str, typer.Option("--backend", help="auto, llamacpp, torch or mlx (auto: llamacpp for GGUF, else torch).")
]
SpeculateOpt = Annotated[
    str, typer.Option("--speculate", help="Speculative decoding: off, ngram (prompt lookup), draft:PATH (a smaller "
                      "model with the same tokenizer) or self:N (this model with N layers skipped; torch/mlx).")
]


MemoryBudgetOpt = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option("--memory-budget", help="Fit the model into this much memory (12GB, 800MiB or bytes): the planner "
                 "picks weight format, KV type and expert streaming, and says what it chose."),
]
AllowPruningOpt = Annotated[
    bool, typer.Option("--allow-pruning", help="Let --memory-budget remove layers when nothing else fits (lossy).")
]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel ranks (torch backend; one process each).")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel groups for MoE models (torch backend).")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline stages (torch backend; contiguous layers each).")]
MmprojOpt = Annotated[str, typer.Option(
    "--mmproj", help="llama.cpp: the projector file (mmproj GGUF) a GGUF model reads images through; 'auto' takes "
    "the one mmproj*.gguf beside the model that fits it, 'off' none.")]
MaxBatchTokensOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--max-batch-tokens", help="Tokens one engine step computes, prompt chunks and decodes together (default: the "
    "runner's: 2048 on llama.cpp, as llama-server's batch; 512 otherwise). Lower cuts the inter-token pause while "
    "new prompts prefill.")]


@app.command()
def generate(
    model_or_prompt: Annotated[str, typer.Argument(metavar="[MODEL] PROMPT", help="Optional model, then the prompt.")],
    prompt: Annotated[Optional[str], typer.Argument(show_default=False, hidden=True)] = None,  # noqa: UP045
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 means greedy.")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 0.95,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: all).")] = 64,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed for reproducible sampling.")] = None,  # noqa: UP045
    backend: BackendOpt = "auto",
    chat: Annotated[
        Optional[bool],  # noqa: UP045
        typer.Option("--chat/--raw", help="Wrap the prompt in the chat template (default: only for chat-tuned models)."),
    ] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU compute threads (default: the physical cores this process may use).")] = None,  # noqa: UP045
    speculate: SpeculateOpt = "off",
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    pp: PpOpt = 1,
    memory_budget: MemoryBudgetOpt = None,
    allow_pruning: AllowPruningOpt = False,
    mmproj: MmprojOpt = "auto",
) -> None:
    """Stream a completion of PROMPT to stdout."""
    from twinfer.app import OpenOptions
    from twinfer.cli.generate_cmd import GenerateOptions, run_generate
    from twinfer.runtime.engine import SamplingParams

    model = model_or_prompt if prompt is not None else None
    text = prompt if prompt is not None else model_or_prompt
    run_generate(GenerateOptions(
        OpenOptions(model, backend, max_seqs=1, threads=threads, speculate=speculate, parallel=(tp, ep, pp),
                    memory_budget=memory_budget, allow_pruning=allow_pruning, mmproj=mmproj),
        prompt=text, chat=chat,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)))


@eval_app.command("kl")
def eval_kl(
    model: ModelArg = None,
    reference: Annotated[str, typer.Option("--reference", help="SPEC: llamacpp, torch, mlx, transformers or a model path.")] = "transformers",
    candidate: Annotated[str, typer.Option("--candidate", help="SPEC: llamacpp, torch, mlx, transformers, a model path or an OpenAI-compatible URL (http://host:port/v1); a backend may take options: torch:kv=tq4, torch:weights=int4, mlx:kv=tq2.5, llamacpp:kv=q4_0.")] = "torch",
    corpus: Annotated[str, typer.Option("--corpus", help="prose, code, or a text file path.")] = "prose",
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens of the corpus to score.")] = 512,
    window: Annotated[int, typer.Option("--window", help="Teacher-forced window length.")] = 256,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    top_k: Annotated[int, typer.Option("--top-k", help="Top logprobs asked of a URL candidate (<= 20).")] = 20,
    api_key_env: Annotated[str, typer.Option("--api-key-env", help="Variable holding a URL candidate's API key.")] = "OPENAI_API_KEY",
    probes: Annotated[int, typer.Option("--probes", help="logit_bias probes per position of a URL candidate: the reference's likeliest tokens outside its top k.")] = 0,
    probe_seconds: Annotated[float, typer.Option("--probe-seconds", help="Time limit on all probes, in seconds.")] = 60.0,
) -> None:
    """KL(reference || candidate) of next-token distributions on the same token stream; an endpoint
    candidate (http(s)://.../v1) is estimated from its top-k logprobs."""
    from twinfer.cli.eval_cmd import EvalKLOptions, RemoteOptions, run_eval_kl

    remote = RemoteOptions(top_k=top_k, api_key_env=api_key_env, probes=probes, probe_seconds=probe_seconds)
    run_eval_kl(EvalKLOptions(model, reference, candidate, corpus=corpus, tokens=tokens, window=window,
                              json_out=json_out, remote=remote))


# -- commands added by later modules go below this line (keep each body a lazy import) ----------


@app.command()
def doctor(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Argument(help="Text to run (default: 64 tokens of the prose corpus).")] = None,  # noqa: UP045
    tokens: Annotated[int, typer.Option("--tokens", help="At most this many prompt tokens.")] = 64,
    memory_budget: MemoryBudgetOpt = None,
    skip: Annotated[Optional[list[str]], typer.Option("--skip", help="A stage to leave out (repeatable), e.g. 'TP=2 (gloo)'.")] = None,  # noqa: UP045
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the result (stages, hardware, versions, git revision) here.")] = None,  # noqa: UP045
) -> None:
    """Run the same tokens through every stage (reference, graphs, llama.cpp, budget, TP/EP, speculation,
    batching) and name the first one that changes the model more than it may. Exit 1 when one does."""
    from twinfer.cli.doctor_cmd import run_doctor_cmd

    run_doctor_cmd(model, prompt, tokens, memory_budget, skip or [], json_out)


@app.command()
def bench(
    model: ModelArg = None,
    concurrency: Annotated[str, typer.Option("--concurrency", "-c", help="Comma-separated levels, e.g. 1,4,16.")] = "1,4,16",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", "-p", help="Prompt length in tokens.")] = 64,
    output_tokens: Annotated[int, typer.Option("--output-tokens", "-o", help="Tokens generated per request.")] = 64,
    shared_prefix: Annotated[int, typer.Option("--shared-prefix", help="Leading prompt tokens all requests share.")] = 0,
    requests_per_client: Annotated[int, typer.Option("--requests-per-client", help="Requests per concurrent client.")] = 2,
    corpus: Annotated[str, typer.Option("--corpus", help="Where prompts come from: prose, code or a text file.")] = "prose",
    backend: BackendOpt = "auto",
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU compute threads (default: the physical cores this process may use).")] = None,  # noqa: UP045
    url: Annotated[Optional[str], typer.Option("--url", help="Bench a running twinfer/OpenAI server instead.")] = None,  # noqa: UP045
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="TWINFER_API_KEY", help="Bearer key for --url.")] = None,  # noqa: UP045
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    speculate: SpeculateOpt = "off",
    max_batch_tokens: MaxBatchTokensOpt = None,
    memory_budget: MemoryBudgetOpt = None,
    allow_pruning: AllowPruningOpt = False,
) -> None:
    """Throughput and latency at given concurrency, with hardware, build and traffic shape attached."""
    from twinfer.cli.bench_cmd import BenchOptions, run_bench_cmd

    run_bench_cmd(BenchOptions(
        model, concurrency, prompt_tokens=prompt_tokens, output_tokens=output_tokens, shared_prefix=shared_prefix,
        requests_per_client=requests_per_client, corpus=corpus, backend=backend, threads=threads, url=url,
        api_key=api_key, json_out=json_out, speculate=speculate, max_batch_tokens=max_batch_tokens,
        memory_budget=memory_budget, allow_pruning=allow_pruning))


@app.command()
def chat(
    model: ModelArg = None,
    backend: BackendOpt = "auto",
    system: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--system", "-s", help="System prompt (default: 'You are a helpful assistant.'; '' for none).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="Sampling temperature; 0 means greedy.")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 0.95,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens per reply.")] = 512,
    seed: Annotated[Optional[int], typer.Option(  # noqa: UP045
        "--seed", help="Seed for reproducible replies (a regenerated reply uses the next seed).")] = None,
    ctx: Annotated[int, typer.Option("--ctx", help="Context window in tokens (history + reply); old turns are dropped past it.")] = 4096,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU compute threads (default: the physical cores this process may use).")] = None,  # noqa: UP045
    template: Annotated[Optional[bool], typer.Option(  # noqa: UP045
        "--template/--transcript",
        help="Format the chat with the model's chat template, or as a plain User:/Assistant: transcript "
             "(default: template for chat-tuned models, transcript for base models such as the default).")] = None,
    resume: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--resume", help="Reopen a saved conversation: its id (the file name without .json) or 'last'.")] = None,
    data_dir: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--data-dir", envvar="TWINFER_DATA_DIR", show_envvar=True,
        help="Where conversations are saved, under conversations/ (default: the user data dir, e.g. "
             "~/.local/share/twinfer).")] = None,
    memory_budget: MemoryBudgetOpt = None,
    allow_pruning: AllowPruningOpt = False,
    speculate: SpeculateOpt = "off",
    mmproj: MmprojOpt = "auto",
) -> None:
    """Chat with a model in a terminal UI (Esc stops a reply, Ctrl+R regenerates, Ctrl+S settings, Ctrl+Q quits)."""
    from twinfer.cli.chat_cmd import run_chat
    from twinfer.tui.app import ChatOptions
    from twinfer.tui.backend import LoadOptions
    from twinfer.tui.conversation import DEFAULT_SYSTEM, Settings

    load = LoadOptions(model, backend, ctx=ctx, threads=threads, template=template, memory_budget=memory_budget,
                       allow_pruning=allow_pruning, speculate=speculate, mmproj=mmproj)
    settings = Settings(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    run_chat(ChatOptions(load, DEFAULT_SYSTEM if system is None else system, settings, resume), data_dir)


@app.command()
def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; anything but loopback is reachable by others.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--api-key", envvar="TWINFER_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every /v1 route.")] = None,
    backend: BackendOpt = "auto",
    max_seqs: Annotated[int, typer.Option("--max-seqs", help="Requests computed at once.")] = 16,
    ctx: Annotated[int, typer.Option("--ctx", help="The longest prompt + completion, in tokens; the KV cache holds "
                                      "this many per sequence (KV streams) or for all of them (a unified KV cache; see --kv-layout).")] = 4096,
    threads: Annotated[Optional[int], typer.Option(  # noqa: UP045
        "--threads", help="CPU compute threads (default: the physical cores this process may use).")] = None,
    kv_layout: Annotated[str, typer.Option(
        "--kv-layout", help="llama.cpp KV cache: 'unified' (--ctx cells shared by all sequences), 'streams' "
        "(each sequence its own --ctx cells, llama-server's layout with -np: --max-seqs times the memory, faster) "
        "or 'auto' (streams while they fit in an eighth of the machine's memory, else unified).")] = "auto",
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait beyond --max-seqs; past it, 429.")] = 64,
    served_model_name: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--served-model-name", help="The model name clients send (default: the file or folder name).")] = None,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="Seconds SIGTERM waits for in-flight requests.")] = 30.0,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", help="Largest request body accepted (413 above).")] = 4.0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
    repetition_guard: Annotated[str, typer.Option(
        "--repetition-guard", metavar="[on|off]",
        help="The default of the loop guard, which cuts a generation that repeats itself verbatim (finish_reason "
        "'loop'; thresholds in docs/guard.md); a request's repetition_guard field overrides it, and it is off for "
        "a request with ignore_eos.")] = "on",
    loop_guard: Annotated[bool, typer.Option("--loop-guard/--no-loop-guard", hidden=True,
                                             help="The same as --repetition-guard on/off.")] = True,
    guard_retries: Annotated[int, typer.Option("--guard-retries", help="Retry a looping request with a fresh seed this many times.")] = 0,
    speculate: SpeculateOpt = "off",
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    pp: PpOpt = 1,
    memory_budget: MemoryBudgetOpt = None,
    allow_pruning: AllowPruningOpt = False,
    batch_invariant: Annotated[bool, typer.Option(
        "--batch-invariant", help="llama.cpp: every request's greedy output equals its output alone, whatever else "
        "runs (one KV stream of --ctx tokens per sequence, decode steps of 2-7 rows; slower).")] = False,
    kv_events: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--kv-events", help="Publish vLLM-format KV cache events (ZMQ PUB) on this address to bind, e.g. "
        "tcp://127.0.0.1:5557, for KV-aware routers (llm-d, Dynamo).")] = None,
    replica_name: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--replica-name", envvar="TWINFER_REPLICA_NAME", show_envvar=True,
        help="This replica's name in a cluster: reported in every response's usage.cost.route.")] = None,
    kv_connector: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--kv-connector", help="Hand prompts' KV to and take it from other replicas (prefill/decode "
        "disaggregation; requests carry kv_transfer_params): tcp, or nixl where installed.")] = None,
    kv_host: Annotated[str, typer.Option("--kv-host", help="Address the KV connector listens on and advertises.")] = "127.0.0.1",
    max_batch_tokens: MaxBatchTokensOpt = None,
    batch_wait_ms: Annotated[Optional[float], typer.Option(  # noqa: UP045
        "--batch-wait-ms", help="When idle, keep taking requests that arrive less than this far apart (at most 4x it "
        "in all) so a burst prefills in one step (default: a tenth of a request's last start from idle, at most "
        "50 ms); 0: start on the first at once.")] = None,
    fetch_image_urls: Annotated[bool, typer.Option(
        "--fetch-image-urls", help="Fetch http(s) image URLs that requests name (10 s and --max-image-mb each); "
        "off: only inline base64 images. The server then reaches any address a client names: trusted clients "
        "only.")] = False,
    max_images: Annotated[int, typer.Option("--max-images", help="Image parts one request may carry.")] = 8,
    max_image_mb: Annotated[float, typer.Option("--max-image-mb", help="Largest encoded image accepted (413 above); "
                                                "inline images also count against --max-body-mb.")] = 10.0,
    mmproj: MmprojOpt = "auto",
) -> None:
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."""
    from twinfer.app import OpenOptions
    from twinfer.cli.serve_cmd import ServeOptions, run_serve

    open_options = OpenOptions(model, backend, max_seqs=max_seqs, ctx=ctx, threads=threads, speculate=speculate,
                               parallel=(tp, ep, pp), memory_budget=memory_budget, allow_pruning=allow_pruning,
                               batch_invariant=batch_invariant, kv_layout=kv_layout, mmproj=mmproj)
    run_serve(ServeOptions(
        open_options, host=host, port=port, api_key=api_key, max_queue=max_queue, served_model_name=served_model_name,
        drain_timeout=drain_timeout, max_body_mb=max_body_mb, log_level=log_level, repetition_guard=repetition_guard,
        loop_guard=loop_guard, guard_retries=guard_retries, kv_events=kv_events, replica_name=replica_name,
        kv_connector=kv_connector, kv_host=kv_host, max_batch_tokens=max_batch_tokens, batch_wait_ms=batch_wait_ms,
        fetch_image_urls=fetch_image_urls, max_images=max_images, max_image_mb=max_image_mb))


@app.command()
def cluster(
    model: ModelArg = None,
    replicas: Annotated[int, typer.Option("--replicas", help="twinfer serve replicas behind the gateway.")] = 2,
    prefill: Annotated[int, typer.Option("--prefill", help="Prefill replicas (with --decode: disaggregated serving).")] = 0,
    decode: Annotated[int, typer.Option("--decode", help="Decode replicas (with --prefill).")] = 0,
    policy: Annotated[str, typer.Option("--policy", help="Gateway routing: cache_aware, round_robin or power_of_two.")] = "cache_aware",
    host: Annotated[str, typer.Option("--host", help="Address of the gateway and the replicas.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="The gateway's port (0: any free port).")] = 8000,
    threads: Annotated[Optional[int], typer.Option(  # noqa: UP045
        "--threads", help="Compute threads per replica (default: the physical cores split among the replicas).")] = None,
    ctx: Annotated[int, typer.Option("--ctx", help="KV-cache tokens per replica.")] = 4096,
    max_seqs: Annotated[int, typer.Option("--max-seqs", help="Requests each replica computes at once.")] = 16,
    kv_events: Annotated[bool, typer.Option("--kv-events/--no-kv-events",
                                            help="Each replica publishes vLLM-format KV events (ZMQ).")] = True,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout", help="Seconds to wait for everything to be up.")] = 180.0,
    log_dir: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--log-dir", help="Write each replica's and the gateway's output to files here (default: stderr).")] = None,
) -> None:
    """Replicas of `twinfer serve` behind SGLang's Model Gateway (smg) on one port; Ctrl+C stops them all."""
    from twinfer.cli.cluster_cmd import ClusterConfig, run_cluster

    run_cluster(ClusterConfig(
        model, replicas=replicas, prefill=prefill, decode=decode, policy=policy, host=host, port=port,
        threads=threads, ctx=ctx, max_seqs=max_seqs, kv_events=kv_events, startup_timeout_s=startup_timeout,
        log_dir=Path(log_dir) if log_dir else None))


@app.command()
def prune(
    model: ModelArg = None,
    out: Annotated[str, typer.Option("--out", help="Folder for the pruned model (or a .gguf file path).")] = "pruned",
    layers: Annotated[int, typer.Option("--layers", help="Transformer blocks to remove (see --rank).")] = 0,
    experts: Annotated[int, typer.Option("--experts", help="Routed experts to remove per MoE layer (least routing mass).")] = 0,
    corpus: Annotated[str, typer.Option("--corpus", help="Where layers are ranked: prose, code or a text file.")] = "prose",
    tokens: Annotated[int, typer.Option("--tokens", help="Corpus tokens to rank layers on.")] = 512,
    window: Annotated[int, typer.Option("--window", help="Teacher-forced window length.")] = 256,
    backend: Annotated[str, typer.Option("--backend", help="torch or mlx: the backend that measures influence.")] = "torch",
    kl_tokens: Annotated[int, typer.Option("--kl-tokens", help="Tokens for KL(original || pruned); 0 skips it.")] = 512,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    rank: Annotated[str, typer.Option("--rank", help="How layers are chosen: kl (greedy, each removal the one that "
                                      "keeps KL to the original lowest) or influence (ShortGPT block influence, "
                                      "one pass).")] = "kl",
) -> None:
    """Remove the layers (and experts) that cost least, write the model, report its KL."""
    from twinfer.cli.prune_cmd import PruneOptions, run_prune

    options = PruneOptions(layers=layers, experts=experts, corpus=corpus, tokens=tokens, window=window,
                           backend=backend, kl_tokens=kl_tokens, rank=rank)
    run_prune(model, out, options, json_out)


HardwareOpt = Annotated[
    str,
    typer.Option("--hardware", help="auto (probe this machine), cpu, or a name from `twinfer hw --list`; "
                 "a Mac's memory size goes after @ (m2-max-38c@64)."),
]


@app.command()
def plan(
    model: Annotated[Optional[str], typer.Argument(  # noqa: UP045
        help="GGUF file, model folder, or a catalog name (--list-models). Default: the embedded Gemma 3 270M.")] = None,
    hardware: HardwareOpt = "auto",
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs per node.")] = None,  # noqa: UP045
    nodes: Annotated[Optional[int], typer.Option("--nodes", help="Nodes (pipeline stages span nodes).")] = None,  # noqa: UP045
    fmt: Annotated[str, typer.Option("--format", help="Weight format (bf16, fp8, nvfp4, q4_k_m, tq4...) or auto.")] = "auto",
    kv_format: Annotated[str, typer.Option("--kv-format", help="KV-cache format (bf16, fp8, q8_0, tq4...) or auto.")] = "auto",
    context: Annotated[Optional[int], typer.Option("--context", help="Tokens per sequence (default 4096).")] = None,  # noqa: UP045
    concurrency: Annotated[int, typer.Option("--concurrency", help="Sequences decoded together.")] = 1,
    memory_budget: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--memory-budget", help="Cap on memory used per device, e.g. 12GB.")] = None,
    params: Annotated[Optional[str], typer.Option("--params", help="Plan a model known only by size: 2.8T.")] = None,  # noqa: UP045
    active_params: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--active-params", help="Active parameters per token of a --params MoE: 60B.")] = None,
    layers: Annotated[Optional[int], typer.Option("--layers", help="Layers of a --params model.")] = None,  # noqa: UP045
    experts: Annotated[Optional[int], typer.Option("--experts", help="Routed experts of a --params MoE.")] = None,  # noqa: UP045
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Experts per token of a --params MoE.")] = None,  # noqa: UP045
    calibration: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--calibration", help="JSON file overriding efficiency factors (see planners/calibration.py).")] = None,
    images: Annotated[Optional[int], typer.Option(  # noqa: UP045
        "--images", help="Images per request (default: 1 for a model with a vision encoder, else 0).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the built-in catalog and exit.")] = False,
) -> None:
    """Dry run: what fits, with which strategy, why, and the predicted speed."""
    from twinfer.cli.plan_cmd import PlanOptions, run_plan

    run_plan(PlanOptions(
        model, hardware, gpus=gpus, nodes=nodes, fmt=fmt, kv_format=kv_format, context=context,
        concurrency=concurrency, memory_budget=memory_budget, params=params, active_params=active_params,
        layers=layers, experts=experts, top_k=top_k, calibration=calibration, images=images, json_out=json_out,
        list_models=list_models))


@app.command()
def hw(
    list_table: Annotated[bool, typer.Option("--list", help="Print the published hardware table.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    measure: Annotated[bool, typer.Option("--measure", help="Measure read (and GPU copy) bandwidth.")] = False,
    hardware: HardwareOpt = "auto",
) -> None:
    """The hardware profile the planner sees (detected; --measure probes bandwidth)."""
    from twinfer.cli.hw_cmd import run_hw

    run_hw(list_table, json_out, measure, hardware)


@app.command()
def quantize(
    model: ModelArg = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Folder to write (safetensors + config + tokenizer).")] = None,  # noqa: UP045
    budget: Annotated[Optional[float], typer.Option("--budget", help="Average bits per weight over the layer projections.")] = None,  # noqa: UP045
    formats: Annotated[str, typer.Option("--formats", help="Candidate weight formats, comma-separated.")] = "tq2,tq2.5,tq3,tq3.5,tq4,int4,int8",
    search: Annotated[bool, typer.Option("--search/--uniform", help="Measure per-group sensitivities and search "
                                         "format combinations (else: the best single format that fits).")] = False,
    tokens: Annotated[int, typer.Option("--tokens", help="Corpus tokens the KL is measured on.")] = 256,
    corpus: Annotated[str, typer.Option("--corpus", help="prose, code, or a text file path.")] = "prose",
    granularity: Annotated[str, typer.Option("--granularity", help="Search groups: block (a layer's attn / mlp), layer or tensor.")] = "block",
    verify: Annotated[bool, typer.Option("--verify", help="MODEL is a quantized folder: re-check its KL window and warn on regression.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    group_size: Annotated[Optional[int], typer.Option("--group-size", help="Affine (int4/int8) group: 32, 64 or 128 "  # noqa: UP045
                                                      "(default 64; 32 with --gguf).")] = None,
    gguf: Annotated[bool, typer.Option("--gguf", help="Also write DIR/model.gguf for llama.cpp (GGUF sources; int4 -> "
                                       "Q4_1, mxfp4 -> MXFP4, no requantization). With a quantized folder as MODEL "
                                       "and no --out: export it.")] = False,
    gguf_int8: Annotated[bool, typer.Option("--gguf-int8-q8_0", help="With --gguf: requantize int8 tensors to Q8_0 "
                                            "(lossy; without it int8 refuses to export).")] = False,
) -> None:
    """Quantize MODEL's weights to a bit budget, choosing formats by measured KL; write a loadable folder."""
    from twinfer.cli.quantize_cmd import QuantizeOptions, run_quantize

    options = QuantizeOptions(budget, tuple(f.strip() for f in formats.split(",") if f.strip()), search=search,
                              tokens=tokens, corpus=corpus, granularity=granularity, group_size=group_size,
                              gguf=gguf, gguf_int8=gguf_int8)
    run_quantize(model, out, options, verify, json_out)


def main() -> None:
    try:
        app()
    except TwinferError as exc:
        print(f"twinfer: error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("twinfer: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()

//! The command line's definition (clap). It depends only on clap and the library, so the man page
//! test (`tests/cli_man.rs`) can include this file and render `man/epcomm.1` from it.

use clap::{Arg, ArgAction, ArgMatches, Args, Command, FromArgMatches, Parser, Subcommand};

use epcomm::num::FloatKind;
use epcomm::select::config::{CONFIG_KEYS, EPLB_CONFIG_KEYS};
use epcomm::select::versions::{releases, DEFAULT_VERSION};

/// vLLM's short flags, which are longer than one letter (argparse allows that, clap does not):
/// `main` rewrites them to the long form before parsing.
pub const SHORT_ALIASES: [(&str, &str); 4] = [
    ("-tp", "--tensor-parallel-size"),
    ("-dp", "--data-parallel-size"),
    ("-pp", "--pipeline-parallel-size"),
    ("-pcp", "--prefill-context-parallel-size"),
];

/// Help that starts with the usage line, as `--help` users grep for it.
const HELP_TEMPLATE: &str =
    "{usage-heading} {usage}\n\n{about-with-newline}\n{all-args}{after-help}";

/// The command line with every subcommand's help starting with its usage.
pub fn command() -> Command {
    fn usage_first(cmd: Command) -> Command {
        cmd.help_template(HELP_TEMPLATE)
            .mut_subcommands(usage_first)
    }
    usage_first(<Cli as clap::CommandFactory>::command())
}

/// Parses `args` (the program name first) with [`command`].
pub fn parse(args: Vec<std::ffi::OsString>) -> Result<Cli, clap::Error> {
    let m = command().try_get_matches_from(args)?;
    Cli::from_arg_matches(&m)
}

/// `epcomm`: check a configuration before launch, list backends, run the demo, benchmark.
#[derive(Parser, Debug)]
#[command(
    name = "epcomm",
    version,
    about = "vLLM's expert-parallel communication layer: check a configuration, list the all2all backends, run the demo, benchmark",
    long_about = None,
    after_help = "On error `check` prints `{Exception}: {message}` as the first line of stderr (vLLM's exact message), then `hint: ...`, and exits 1. A usage error exits 2."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Cmd>,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Check a vLLM configuration (JSON and vLLM-style flags) the way vLLM would at start-up
    Check(CheckArgs),
    /// List the all2all backend and EPLB communicator names a vLLM release accepts, with their
    /// status there and what epcomm runs for them
    Backends {
        /// Print the all2all names as one JSON array
        #[arg(long)]
        json: bool,
        #[arg(long = "vllm-version", value_name = "V", default_value = DEFAULT_VERSION,
              help = vllm_version_short(), long_help = vllm_version_help())]
        vllm_version: String,
    },
    /// Run MoE steps per backend on rank processes and check every output against a reference
    Demo(DemoArgs),
    /// Benchmarks over shared memory, nccl-tests style tables
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    /// Print the version
    Version,
}

/// `--vllm-version`'s short help.
fn vllm_version_short() -> String {
    format!(
        "vLLM release whose names apply; rules and messages other than the name sets follow \
         v{DEFAULT_VERSION}"
    )
}

/// `--vllm-version`'s long help, with the releases the table holds.
fn vllm_version_help() -> String {
    let all = releases();
    format!(
        "The vLLM release whose all2all backend and EPLB communicator names apply (0.31.0, \
         v0.31.0 and 0.33.0+cu129 are accepted): every release from {} (VLLM_ALL2ALL_BACKEND) to \
         {} is known. Rules and messages other than the name sets follow v{DEFAULT_VERSION}.",
        all[0].version,
        all[all.len() - 1].version
    )
}

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// all_to_allv between rank processes against a memcpy of the same bytes
    Group(GroupArgs),
    /// MoE dispatch + combine per backend and tokens per rank
    Moe(MoeArgs),
    /// The EPLB rebalancing policy, then an expert-weight transfer between rank processes
    Eplb(EplbArgs),
}

/// A positive integer option.
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("expected a positive integer, got 0".into()),
        Ok(v) => Ok(v),
        Err(_) => Err(format!("expected a positive integer, got '{s}'")),
    }
}

/// A `--dtype` value: bf16, f16 or f32 (torch's long names too).
pub fn dtype(s: &str) -> Result<FloatKind, String> {
    match s {
        "bf16" | "bfloat16" => Ok(FloatKind::Bf16),
        "f16" | "fp16" | "float16" => Ok(FloatKind::F16),
        "f32" | "fp32" | "float32" => Ok(FloatKind::F32),
        other => Err(format!("expected bf16, f16 or f32, got '{other}'")),
    }
}

/// Expert popularity of the demo's routing.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DemoRouting {
    /// Zipf-like: a few hot experts
    Skewed,
    /// Every expert equally likely
    Uniform,
}

/// Routing of the MoE benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchRouting {
    /// Every expert equally likely
    Uniform,
    /// Zipf-like: a few hot experts
    Skewed,
    /// Every token picks two experts of one other rank, the rest masked
    Top2,
}

impl BenchRouting {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            BenchRouting::Uniform => "uniform",
            BenchRouting::Skewed => "skewed",
            BenchRouting::Top2 => "top2",
        }
    }
}

/// Options of `epcomm demo`.
#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Backends to run (comma separated; `all` for every backend)
    #[arg(
        long = "backend",
        value_name = "NAME",
        value_delimiter = ',',
        default_value = "all"
    )]
    pub backends: Vec<String>,
    /// Rank processes
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = positive)]
    pub ranks: usize,
    /// Tokens per rank (each rank and step uses between T/2 and T)
    #[arg(long, value_name = "T", default_value_t = 256)]
    pub tokens: usize,
    /// Hidden size
    #[arg(long, value_name = "H", default_value_t = 1024, value_parser = positive)]
    pub hidden: usize,
    /// Experts (a multiple of --ranks)
    #[arg(long, value_name = "E", default_value_t = 32, value_parser = positive)]
    pub experts: usize,
    /// Experts per token
    #[arg(long, value_name = "K", default_value_t = 4, value_parser = positive)]
    pub topk: usize,
    /// Element type: bf16, f16 or f32
    #[arg(long = "dtype", value_name = "bf16|f16|f32", default_value = "bf16", value_parser = dtype)]
    pub kind: FloatKind,
    /// Seed of the inputs, routing and expert weights
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// MoE steps per backend
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive)]
    pub steps: usize,
    /// Expert popularity
    #[arg(long, value_enum, default_value_t = DemoRouting::Skewed)]
    pub routing: DemoRouting,
}

/// Options of `epcomm bench group`.
#[derive(Args, Debug, Clone)]
pub struct GroupArgs {
    /// Rank processes
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive)]
    pub ranks: usize,
    /// MiB each rank receives per all_to_allv
    #[arg(long, value_name = "MiB", default_value_t = 64, value_parser = positive)]
    pub mib: usize,
    /// Timed iterations
    #[arg(long, value_name = "N", default_value_t = 30, value_parser = positive)]
    pub iters: usize,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
}

// --backend as DemoArgs declares it, with this command's default: clap's attributes take no
// parameter, so each command writes its own.
/// Options of `epcomm bench moe`.
#[derive(Args, Debug, Clone)]
pub struct MoeArgs {
    /// Backends (comma separated; `all` for every backend epcomm implements)
    #[arg(
        long = "backend",
        value_name = "NAME",
        value_delimiter = ',',
        default_value = "deepep_high_throughput"
    )]
    pub backends: Vec<String>,
    /// Rank processes, one run each (comma separated) [default: 2; 2,4,8 with --sweep]
    #[arg(long = "ranks", value_name = "N", value_delimiter = ',', value_parser = positive)]
    pub rank_counts: Vec<usize>,
    /// The ranks of the run in progress (one of --ranks).
    #[arg(skip)]
    pub ranks: usize,
    /// Tokens per rank, one case each (comma separated) [default: 128,4096; 1,2,4,...,8192
    /// with --sweep]
    #[arg(long, value_name = "T", value_delimiter = ',')]
    pub tokens: Vec<usize>,
    /// How cost grows: T = 1, 2, 4, ..., 8192 and R = 2, 4, 8 unless --tokens or --ranks say
    /// otherwise, with fewer iterations at large T (--iters x 256 / T, at least 3)
    #[arg(long)]
    pub sweep: bool,
    /// Hidden size
    #[arg(long, value_name = "H", default_value_t = 7168, value_parser = positive)]
    pub hidden: usize,
    /// Experts (a multiple of --ranks)
    #[arg(long, value_name = "E", default_value_t = 256, value_parser = positive)]
    pub experts: usize,
    /// Experts per token
    #[arg(long, value_name = "K", default_value_t = 8, value_parser = positive)]
    pub topk: usize,
    /// Element type: bf16, f16 or f32
    #[arg(long = "dtype", value_name = "bf16|f16|f32", default_value = "bf16", value_parser = dtype)]
    pub kind: FloatKind,
    /// Routing of the tokens
    #[arg(long, value_enum, default_value_t = BenchRouting::Uniform)]
    pub routing: BenchRouting,
    /// Timed iterations per case
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = positive)]
    pub iters: usize,
    /// Untimed iterations before them
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub warmup: usize,
    /// Print one JSON array of the rows instead of the table
    #[arg(long)]
    pub json: bool,
    /// Also write SVG charts: GB/s against T to FILE (to STEM-rR.svg per R when --ranks lists
    /// several, STEM being FILE less .svg) and microseconds per token to STEM-us-per-token.svg
    #[arg(long, value_name = "FILE")]
    pub svg: Option<String>,
    /// Also run every case with FP8 dispatch (rows `BACKEND+fp8`, next to the plain ones in the
    /// same run): hidden rows quantised to float8_e4m3fn with one float32 scale per 128
    /// elements; --hidden must be a multiple of 128
    #[arg(long)]
    pub fp8: bool,
}

/// Options of `epcomm bench eplb`.
#[derive(Args, Debug, Clone)]
pub struct EplbArgs {
    /// Timed iterations (policy runs and transfers)
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = positive)]
    pub iters: usize,
    /// Rank processes (at least 2)
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = positive)]
    pub ranks: usize,
    /// MoE layers moved per transfer
    #[arg(long, value_name = "L", default_value_t = 4, value_parser = positive)]
    pub layers: usize,
    /// Expert slots per rank and layer (at least 2)
    #[arg(long = "experts-per-rank", value_name = "N", default_value_t = 16, value_parser = positive)]
    pub per_rank: usize,
    /// MiB of weights per expert
    #[arg(long = "expert-mib", value_name = "MiB", default_value_t = 4, value_parser = positive)]
    pub expert_mib: usize,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
}

/// Options of `epcomm check`: `--config`, one flag per vLLM configuration key and per
/// `eplb_config` key, and `--json`. Built with clap's builder API from the library's key lists,
/// so a key added there gets its flag here.
#[derive(Debug, Clone, Default)]
pub struct CheckArgs {
    /// `--config`: a JSON object or a file holding one.
    pub config: Option<String>,
    /// `--json`: print the outcome as JSON.
    pub json: bool,
    /// `--eplb-config`: a JSON object.
    pub eplb_config: Option<String>,
    /// Configuration keys given as flags, with their raw values (`true` for a bare switch).
    pub flags: Vec<(String, String)>,
    /// `--eplb-config.KEY VALUE` pairs.
    pub eplb: Vec<(String, String)>,
    /// `--vllm-version`: the release whose names are checked (the `vllm_version` key).
    pub vllm_version: Option<String>,
    /// `--vllm-src`: a vLLM source tree or installed package whose own source says what it
    /// accepts (the `vllm_release` key).
    pub vllm_src: Option<String>,
}

/// The switches among the configuration keys: `--flag` means true, `--flag=false` false.
pub const BOOL_KEYS: [&str; 11] = [
    "mori_ep_v2",
    "numa_bind",
    "draft_model_is_moe",
    "enable_expert_parallel",
    "enable_eplb",
    "enable_elastic_ep",
    "enable_dbo",
    "enable_fault_tolerance",
    "enable_lora",
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
];

/// Configuration keys whose flags are defined apart from the per-key loop.
const OWN_FLAGS: [&str; 2] = ["eplb_config", "vllm_version"];

/// (value name, help) of a configuration key's flag.
fn key_help(key: &str) -> (&'static str, &'static str) {
    match key {
        "all2all_backend" => ("NAME", "all2all backend name, as vLLM's --all2all-backend"),
        "enable_expert_parallel" => ("", "Use expert parallelism for the MoE layers"),
        "enable_eplb" => ("", "Enable the expert-parallel load balancer"),
        "enable_elastic_ep" => ("", "Enable elastic EP (scale up/down)"),
        "enable_dbo" => ("", "Enable dual-batch overlap (microbatching)"),
        "enable_fault_tolerance" => ("", "Enable fault tolerance"),
        "enable_lora" => ("", "Enable LoRA"),
        "numa_bind" => (
            "",
            "Bind workers to their GPU's NUMA node (default: vLLM decides)",
        ),
        "mori_ep_v2" => (
            "",
            "Whether 'mori' runs MoRI EPv2 (vLLM 0.34.0; default: vLLM decides)",
        ),
        "expert_placement_strategy" => ("linear|round_robin", "Expert placement strategy"),
        "draft_model_is_moe" => ("", "The speculative decoding draft model is an MoE model"),
        "tensor_parallel_size" => ("N", "Tensor-parallel size [short: -tp]"),
        "data_parallel_size" => ("N", "Data-parallel size [short: -dp]"),
        "pipeline_parallel_size" => ("N", "Pipeline-parallel size [short: -pp]"),
        "prefill_context_parallel_size" => ("N", "Prefill context-parallel size [short: -pcp]"),
        "data_parallel_external_lb" => ("", "Data parallelism with an external load balancer"),
        "data_parallel_hybrid_lb" => ("", "Data parallelism with the hybrid load balancer"),
        "platform" => ("cuda|rocm|cpu|xpu", "Platform the configuration runs on"),
        "num_experts" => ("N", "Number of routed experts of the model"),
        "nixl_available" => ("true|false", "Whether NIXL is installed (default: probed)"),
        "nccl_available" => ("true|false", "Whether NCCL is usable (default: probed)"),
        _ => ("VALUE", "Configuration key of the same name"),
    }
}

/// The flag name of a configuration key (`data_parallel_size` -> `data-parallel-size`).
fn flag_name(key: &str) -> String {
    key.replace('_', "-")
}

impl Args for CheckArgs {
    fn augment_args(cmd: Command) -> Command {
        let mut cmd = cmd
            .args_override_self(true)
            .arg(
                Arg::new("config")
                    .long("config")
                    .value_name("JSON|FILE")
                    .help(
                    "The configuration as a JSON object, or a file holding one; flags override it",
                ),
            )
            .arg(
                Arg::new("json")
                    .long("json")
                    .action(ArgAction::SetTrue)
                    .help("Print the outcome as JSON on stdout"),
            )
            .arg(
                Arg::new("vllm_version")
                    .long("vllm-version")
                    .value_name("V")
                    // No clap default: it would override a `vllm_version` given in --config.
                    .help(format!(
                        "{} [default: {DEFAULT_VERSION}]",
                        vllm_version_short()
                    ))
                    .long_help(vllm_version_help()),
            )
            .arg(
                Arg::new("vllm_src")
                    .long("vllm-src")
                    .value_name("DIR")
                    .help(
                        "Check against the vLLM in DIR (a source tree, site-packages or the installed vllm package): its own config/parallel.py and cuda_communicator.py say what it accepts, so a release newer than epcomm's table validates too (needs python3; $EPCOMM_PYTHON names another)",
                    ),
            )
            .arg(
                Arg::new("eplb_config")
                    .long("eplb-config")
                    .value_name("JSON")
                    .help(
                        "vLLM's EPLBConfig as a JSON object; --eplb-config.KEY flags override it",
                    ),
            );
        for key in CONFIG_KEYS.iter().filter(|k| !OWN_FLAGS.contains(k)) {
            let (value, help) = key_help(key);
            let mut arg = Arg::new(*key).long(flag_name(key)).help(help);
            arg = if BOOL_KEYS.contains(key) {
                arg.num_args(0..=1)
                    .require_equals(true)
                    .default_missing_value("true")
                    .value_name("true|false")
            } else {
                arg.value_name(value)
            };
            cmd = cmd.arg(arg);
        }
        for key in EPLB_CONFIG_KEYS {
            cmd = cmd.arg(
                Arg::new(format!("eplb_config.{key}"))
                    .long(format!("eplb-config.{key}"))
                    .value_name("VALUE")
                    .help(format!("eplb_config's `{key}`")),
            );
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for CheckArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut a = CheckArgs::default();
        a.update_from_arg_matches(m)?;
        Ok(a)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        let text = |id: &str| m.get_one::<String>(id).cloned();
        self.config = text("config");
        self.json = m.get_flag("json");
        self.eplb_config = text("eplb_config");
        self.vllm_version = text("vllm_version");
        self.vllm_src = text("vllm_src");
        self.flags = CONFIG_KEYS
            .iter()
            .filter(|k| !OWN_FLAGS.contains(k))
            .filter_map(|k| text(k).map(|v| ((*k).to_owned(), v)))
            .collect();
        self.eplb = EPLB_CONFIG_KEYS
            .iter()
            .filter_map(|k| text(&format!("eplb_config.{k}")).map(|v| ((*k).to_owned(), v)))
            .collect();
        Ok(())
    }
}

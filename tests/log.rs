//! Log routing: vLLM's warnings reach the sink with vLLM's wording; `warning_once` texts once.
//! One test function, so the once-per-process state is predictable.

use std::sync::{Arc, Mutex};

use epcomm::log::{self, Level};
use epcomm::select::all2all;

#[test]
fn warnings_reach_the_sink_once_where_vllm_warns_once() {
    let seen: Arc<Mutex<Vec<(Level, String)>>> = Arc::default();
    let s = seen.clone();
    log::set_sink(Some(Arc::new(move |l, m| {
        s.lock().unwrap().push((l, m.to_owned()))
    })));

    all2all::resolve("naive").unwrap();
    all2all::resolve("naive").unwrap();
    all2all::resolve("flashinfer_all2allv").unwrap();
    all2all::resolve("flashinfer_all2allv").unwrap();
    all2all::resolve("deepep_low_latency").unwrap();
    assert!(all2all::resolve("bogus").is_err());

    let w2 =
        "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'.";
    let w1 = "'flashinfer_all2allv' is deprecated and has been renamed to'flashinfer_nvlink_two_sided'. It will be removed in a futurerelease.";
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (Level::Warn, w2.to_owned()),
            (Level::Warn, w2.to_owned()),
            (Level::Warn, w1.to_owned()),
        ]
    );

    // Infos reach a sink; debug only at debug level.
    seen.lock().unwrap().clear();
    log::info("hello");
    log::log(Level::Debug, "dbg");
    log::set_level(Level::Debug);
    log::log(Level::Debug, "dbg2");
    log::set_level(Level::Warn);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (Level::Info, "hello".to_owned()),
            (Level::Debug, "dbg2".to_owned())
        ]
    );

    // The config checker logs every warning it reports.
    seen.lock().unwrap().clear();
    let o = epcomm::select::config::check_json(r#"{"all2all_backend": "pplx"}"#, false, false);
    assert!(o.result.is_ok());
    assert!(seen.lock().unwrap().contains(&(
        Level::Warn,
        "The 'pplx' all2all backend has been removed. Falling back to 'allgather_reducescatter'."
            .to_owned()
    )));
    log::set_sink(None);

    assert_eq!(Level::parse("WARNING"), Some(Level::Warn));
    assert_eq!(Level::parse("debug"), Some(Level::Debug));
    assert_eq!(Level::parse("loud"), None);
}

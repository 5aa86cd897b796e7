use super::*;

/// The documented defaults (README, http-api.md "Running it").
const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
const DEFAULT_DATA_DIR: &str = "./meshd-data";

/// `--config` with `text` in it, and the file's directory (removed when dropped).
fn with_file(text: &str) -> (ServeArgs, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meshd.toml");
    std::fs::write(&path, text).unwrap();
    let args = ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    };
    (args, dir)
}

#[test]
fn defaults_are_the_documented_ones() {
    let c = Config::resolve(ServeArgs::default()).unwrap();
    assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
    assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
    assert_eq!(c.meta, MetaBackend::Embedded);
    assert_eq!(c.lease_ttl_ms, 10_000);
}

#[test]
fn flags_win_over_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meshd.toml");
    std::fs::write(&path, "listen = \"127.0.0.1:9999\"\nlease_ttl_ms = 5000\n").unwrap();
    let c = Config::resolve(ServeArgs {
        config: Some(path),
        listen: Some("127.0.0.1:1234".into()),
        ..ServeArgs::default()
    })
    .unwrap();
    assert_eq!(c.listen.port(), 1234);
    assert_eq!(c.lease_ttl_ms, 5000);
}

#[test]
fn bad_values_are_named() {
    let err = Config::resolve(ServeArgs {
        meta: Some("zookeeper://x".into()),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("--meta"), "{err}");
    let err = Config::resolve(ServeArgs {
        listen: Some("0.0.0.0:7070".into()),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("--insecure-listen"), "{err}");
    let err = Config::resolve(ServeArgs {
        lease_ttl_ms: Some(5),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("--lease-ttl-ms"), "{err}");
}

#[test]
fn the_log_is_embedded_or_a_jetstream_url_and_cluster_mode_caps_in_flight() {
    let c = Config::resolve(ServeArgs::default()).unwrap();
    assert_eq!(c.log, LogBackend::Embedded);
    let c = Config::resolve(ServeArgs {
        log: Some("nats://127.0.0.1:4222".into()),
        ..ServeArgs::default()
    })
    .unwrap();
    assert!(c.log.is_cluster());
    for bad in ["kafka://x", "nats://", "nats://h:1?replicas=9"] {
        let err = Config::resolve(ServeArgs {
            log: Some(bad.into()),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--log"), "{bad}: {err}");
    }
    let err = Config::resolve(ServeArgs {
        log: Some("nats://127.0.0.1:4222".into()),
        max_in_flight: Some(50_000),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("--max-in-flight"), "{err}");
}

#[test]
fn unknown_file_keys_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meshd.toml");
    std::fs::write(&path, "lisen = \"x\"\n").unwrap();
    let err = Config::resolve(ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("lisen"), "{err}");
    // `config` is a flag only: a file does not name another file.
    let (args, _dir) = with_file("config = \"other.toml\"\n");
    let err = Config::resolve(args).unwrap_err();
    assert!(err.to_string().contains("unknown field `config`"), "{err}");
}

#[test]
fn every_default_is_inside_its_range() {
    let c = Config::read(ServeArgs::default()).unwrap();
    let bounded = c.bounded();
    assert!(bounded.len() >= 25, "{bounded:?}");
    for (flag, value, accepts) in bounded {
        assert!(
            accepts.contains(value),
            "{flag}: {value} outside {accepts:?}"
        );
    }
    // The ones checked against other settings.
    assert!(c.max_streams_per_token <= c.max_long_polls);
    assert!(c.max_long_polls < c.max_requests);
}

#[test]
fn every_environment_variable_is_meshd_and_the_flag_in_capitals() {
    use clap::Args;
    let serve = ServeArgs::augment_args(clap::Command::new("serve"));
    let mut settings = 0;
    for arg in serve.get_arguments() {
        let long = arg.get_long().expect("every setting is a --flag");
        let env = format!("MESHD_{}", long.to_ascii_uppercase().replace('-', "_"));
        assert_eq!(arg.get_env().and_then(|e| e.to_str()), Some(env.as_str()));
        assert_eq!(
            long.replace('-', "_"),
            arg.get_id().as_str(),
            "the file's key"
        );
        settings += 1;
    }
    assert!(settings >= 58, "{settings} settings");
    // The one test knob stays out of --help.
    let hidden: Vec<_> = serve.get_arguments().filter(|a| a.is_hide_set()).collect();
    assert_eq!(hidden.len(), 1);
    assert_eq!(hidden[0].get_long(), Some("meta-compaction-check-ms"));
}

#[test]
fn a_number_outside_its_range_is_refused_naming_the_flag() {
    for (flag, _, accepts) in Config::read(ServeArgs::default()).unwrap().bounded() {
        let key = flag.trim_start_matches("--").replace('-', "_");
        let mut bad = vec![accepts.hi + 1];
        if accepts.lo > 1 || (accepts.lo == 1 && !accepts.zero_is_off) {
            bad.push(accepts.lo - 1);
        }
        for v in bad {
            let (args, _dir) = with_file(&format!("{key} = {v}\n"));
            let err = Config::resolve(args).unwrap_err().to_string();
            assert!(
                err.contains(&flag) && err.contains("must be between"),
                "{err}"
            );
        }
    }
    let err = Config::resolve(ServeArgs {
        log_retention_hours: Some(0),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(
        err.to_string().contains("between 1 and 876000 hours"),
        "{err}"
    );
}

#[test]
fn zero_turns_meta_compaction_off_and_streams_per_token_stay_below_long_polls() {
    let c = Config::resolve(ServeArgs {
        meta_compaction_retention: Some(0),
        max_streams_per_token: Some(512),
        ..ServeArgs::default()
    })
    .unwrap();
    assert_eq!(c.meta_compaction_retention, 0);
    let err = Config::resolve(ServeArgs {
        max_streams_per_token: Some(513),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("--max-streams-per-token: must be between 0 and 512"),
        "{err}"
    );
}

#[test]
fn a_flag_is_on_when_the_file_turns_it_on_and_defaults_derive_from_settings() {
    let (mut args, _dir) = with_file("insecure_listen = true\nlease_ttl_ms = 4000\n");
    args.listen = Some("0.0.0.0:7070".into());
    let c = Config::resolve(args).unwrap();
    assert!(c.insecure_listen);
    assert_eq!(c.rebalance_delay_ms, 12_000);
    let (args, _dir) = with_file("meta_compaction_check_ms = 200\n");
    assert_eq!(
        Config::resolve(args).unwrap().meta_compaction_check_ms,
        Some(200)
    );
}

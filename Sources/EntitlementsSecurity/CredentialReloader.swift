public import CoreMetrics
public import ServiceLifecycle
public import UnixSignals

/// Reloads the token file when it changes (checked every second) and the token file and
/// TLS files on SIGHUP. A file that cannot be used is reported and the old one kept
/// (counted in entitlements_auth_reload_failures_total).
public final class CredentialReloader: Service, Sendable {
    private let tokens: AccessTokens?
    private let tls: ServerTLS?
    private let signals: UnixSignalsSequence
    private let failures: Counter
    private let say: @Sendable (String) -> Void

    /// `failures` counts reloads that failed (`entitlements_auth_reload_failures_total`);
    /// `say` reports each reload, never a token.
    public init(tokens: AccessTokens?, tls: ServerTLS?, signals: UnixSignalsSequence, failures: Counter, say: @escaping @Sendable (String) -> Void) {
        self.tokens = tokens
        self.tls = tls
        self.signals = signals
        self.failures = failures
        self.say = say
    }

    public func run() async throws {
        await cancelWhenGracefulShutdown {
            await withTaskGroup(of: Void.self) { tasks in
                tasks.addTask {
                    for await _ in self.signals {
                        self.reloadTokens(always: true)
                        self.reloadTLS()
                    }
                }
                tasks.addTask {
                    while !Task.isCancelled {
                        try? await Task.sleep(for: .seconds(1))
                        self.reloadTokens(always: false)
                    }
                }
                await tasks.next()
                tasks.cancelAll()
            }
        }
    }

    private func reloadTokens(always: Bool) {
        guard let tokens = self.tokens else {
            return
        }
        do {
            let changed = always ? try tokens.reload() : try tokens.reloadIfChanged()
            if let changed {
                self.say(changed ? "auth: reloaded \(tokens.path): \(tokens.count) tokens" : "auth: \(tokens.path) unchanged")
            }
        } catch {
            self.failures.increment()
            self.say("auth: cannot reload, keeping the tokens in use: \(error)")
        }
    }

    private func reloadTLS() {
        guard let tls = self.tls else {
            return
        }
        do {
            try tls.reload()
            self.say("tls: reloaded \(tls.files.certificate), valid until \(ServerTLS.date(tls.notValidAfter))")
        } catch {
            self.failures.increment()
            self.say("tls: cannot reload, keeping the certificate in use: \(error)")
        }
    }
}

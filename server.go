package streamq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/internal/keys"
)

// ErrUnsupportedServer is returned at the first use of a Producer, Consumer or
// Admin when the Redis server is older than 7.0, which streamq needs (SET with
// NX and GET, XAUTOCLAIM reporting deleted entries, XINFO lag). Upgrade Redis.
var ErrUnsupportedServer = errors.New("streamq: Redis server too old: 7.0 or newer is needed")

// checkServer verifies that the server is Redis 7.0 or newer and, when log is
// not nil, warns when its maxmemory-policy can evict streamq's keys. It is
// called once at the first use of a Producer, Consumer or Admin.
//
// The version comes from HELLO, which every user may send whatever its ACL
// rules (INFO may be refused) and which in-process test servers answer too,
// or from INFO server where HELLO is unknown. HELLO is sent with the protocol
// version the client already speaks, so the connection stays as it was.
func checkServer(ctx context.Context, client redis.UniversalClient, log *slog.Logger) error {
	var version string
	reply, err := client.Do(ctx, "HELLO", clientProtocol(client)).Result()
	switch {
	case err == nil:
		version = helloField(reply, "version")
	case isUnknownCommand(err):
		// Redis before 6.0, or a proxy that does not pass HELLO on: ask INFO.
		info, ierr := client.Info(ctx, "server").Result()
		if ierr != nil {
			return fmt.Errorf("%w: the server knows neither HELLO nor INFO server (%v)", ErrUnsupportedServer, ierr)
		}
		version = infoField(info, "redis_version")
	default:
		return fmt.Errorf("streamq: ask the server for its version (HELLO): %w", err)
	}
	if !atLeast7(version) {
		return fmt.Errorf("%w: the server reports version %q", ErrUnsupportedServer, version)
	}
	if log != nil {
		warnEvictionPolicy(ctx, client, log)
	}
	return nil
}

// clientProtocol returns the RESP version the client's connections use.
func clientProtocol(client redis.UniversalClient) int {
	proto := 0
	switch c := client.(type) {
	case *redis.Client:
		proto = c.Options().Protocol
	case *redis.ClusterClient:
		proto = c.Options().Protocol
	case *redis.Ring:
		proto = c.Options().Protocol
	}
	if proto == 2 {
		return 2
	}
	return 3 // go-redis's default
}

// helloField returns a string field of a HELLO reply: a map in RESP3, a flat
// list of names and values in RESP2.
func helloField(reply any, name string) string {
	switch r := reply.(type) {
	case map[any]any:
		s, _ := r[name].(string)
		return s
	case map[string]any:
		s, _ := r[name].(string)
		return s
	case []any:
		for i := 0; i+1 < len(r); i += 2 {
			if k, _ := r[i].(string); k == name {
				s, _ := r[i+1].(string)
				return s
			}
		}
	}
	return ""
}

// isUnknownCommand reports whether err is the server's refusal of a command
// it does not know.
func isUnknownCommand(err error) bool {
	var rerr redis.Error
	return errors.As(err, &rerr) && strings.Contains(strings.ToLower(err.Error()), "unknown command")
}

// infoField returns a field of an INFO reply ("name:value" lines).
func infoField(info, name string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

// atLeast7 reports whether version ("7.0.15") is 7.0 or newer.
func atLeast7(version string) bool {
	major, _, _ := strings.Cut(version, ".")
	n, err := strconv.Atoi(major)
	return err == nil && n >= 7
}

// warnEvictionPolicy logs a warning when the server's maxmemory-policy can
// evict streamq's keys. A user whose ACL refuses CONFIG GET (managed services
// often do) gets a debug line instead.
func warnEvictionPolicy(ctx context.Context, client redis.UniversalClient, log *slog.Logger) {
	res, err := client.ConfigGet(ctx, "maxmemory-policy").Result()
	if err != nil {
		if ctx.Err() != nil {
			return // the caller gave up; nothing to say
		}
		log.Debug("streamq: cannot read maxmemory-policy; make sure it is noeviction", "err", err)
		return
	}
	policy := res["maxmemory-policy"]
	switch {
	case strings.HasPrefix(policy, "volatile-"):
		log.Warn("streamq: Redis maxmemory-policy evicts keys with a TTL first: request records (deduplication and results) can vanish under memory pressure; set it to noeviction",
			"maxmemory-policy", policy)
	case strings.HasPrefix(policy, "allkeys-"):
		log.Warn("streamq: Redis maxmemory-policy can evict any key, queue streams included: requests can be lost under memory pressure; set it to noeviction",
			"maxmemory-policy", policy)
	}
}

// channelPermission explains a NOPERM refusal of a subscription: which ACL
// channel rule the user lacks.
func channelPermission(err error, queue string, shards int) error {
	if err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
		return err
	}
	return fmt.Errorf("the Redis user may not use the queue's notice channels: grant them with ACL SETUSER <user> %s (see docs/operating.md, Security): %w",
		keys.ChannelRule(queue, shards), err)
}

package streamqdash_test

import (
	"crypto/subtle"
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq/streamqdash"
)

// The dashboard has no login of its own: the host puts its authentication in
// front of it (here HTTP basic auth; a session check or an SSO proxy works
// the same way) and mounts it under a path of its choice.
func Example_authentication() {
	mr := miniredis.NewMiniRedis() // stands in for your Redis
	if err := mr.Start(); err != nil {
		panic(err)
	}
	defer mr.Close()
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer client.Close()

	dash, err := streamqdash.New(client, nil)
	if err != nil {
		panic(err)
	}
	operatorsOnly := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			user, pass, ok := r.BasicAuth()
			if !ok || subtle.ConstantTimeCompare([]byte(user+":"+pass), []byte("ops:correct horse")) != 1 {
				w.Header().Set("WWW-Authenticate", `Basic realm="streamq"`)
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/queues/", operatorsOnly(http.StripPrefix("/ops/queues", dash)))

	srv := httptest.NewServer(mux) // your http.Server
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/ops/queues/")
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println("without credentials:", resp.StatusCode)
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/ops/queues/", nil)
	req.SetBasicAuth("ops", "correct horse")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println("as ops:", resp.StatusCode)
	// Output:
	// without credentials: 401
	// as ops: 200
}
